"""`gyre eval`: a policy on held-out task instances — the run's harness, tasks and evaluator,
no training.

    gyre eval RUN_DIR                    # the run's final policy (policies/final)
    gyre eval RUN_DIR --initial          # ... and the model it started from, for before/after
    gyre eval RUN_DIR --policies all     # every kept policy: the report's eval points
    gyre eval MODEL_DIR|tiny --config templates/local.yaml [--tasks notes] [--instances 16]

One embedded engine serves the policy; an `ExecutionHost` (the very object a run's proxy
node drives) runs one execution per task instance, `concurrency` at a time. Instances are
drawn from held-out seeds (`gyre.tasks.suite.heldout_seed`, never used for training), the
same ones for every policy, so before/after compare like with like. Each policy's executions
go to `WORK/NAME` (WORK: `--out`, default `RUN_DIR/eval`, else a new temporary directory;
NAME: the policy's name, or a model directory's base name), replaced by each evaluation, so
a second `gyre eval` of a run scores afresh and gives the same answer. Only a directory
`gyre eval` made is ever replaced (`gyre.fsafe`), and WORK may not be, hold or lie inside
what the evaluation reads (the model, the run's policies, config and trace): `gyre eval
MODEL_DIR` leaves the model as it was. For a run directory
the results are also written to `RUN_DIR/eval.json`, which `gyre report` plots, and sent to
the run's trackers (its `tracking:`) as `eval/*` metrics against the policy version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre import fsafe
from gyre.errors import ConfigError
from gyre.models import check_model
from gyre.rollout.protocol import ensure_engine_key
from gyre.runtime.shared import policies
from gyre.runtime.shared.config import DEFAULT_CONFIG, RunConfig, load_run_config
from gyre.runtime.shared.heldout import heldout, run_heldout
from gyre.runtime.shared.run_directory import config_inputs

if TYPE_CHECKING:
    from gyre.runtime.shared.messages import VerdictRecord
    from gyre.tasks.scoring import TestVerdict

EVAL_FILE = "eval.json"
MADE_BY = "gyre eval"  # the marker of its work directories (gyre.fsafe)


@dataclass(slots=True)
class EvalResult:
    """One policy's held-out evaluation."""

    name: str  # initial | final | v00012 | a model path
    version: int | None  # policy version (updates applied); None for a model given by path
    model: str
    rewards: dict[str, float | None] = field(default_factory=dict)  # execution -> reward
    wall_s: float = 0.0
    # execution -> a repository task's per-test outcomes behind its reward (else empty)
    tests: dict[str, tuple[TestVerdict, ...]] = field(default_factory=dict)

    @property
    def scored(self) -> list[float]:
        return [r for r in self.rewards.values() if r is not None]

    @property
    def mean(self) -> float:
        got = self.scored
        return sum(got) / len(got) if got else math.nan

    @property
    def std(self) -> float:
        got = self.scored
        if len(got) < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((r - m) ** 2 for r in got) / (len(got) - 1))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "model": self.model,
                "mean": self.mean, "std": self.std, "n": len(self.scored),
                "excluded": len(self.rewards) - len(self.scored), "rewards": self.rewards,
                "tests": {x: [t.to_dict() for t in self.tests.get(x, ())] for x in self.rewards},
                "wall_s": self.wall_s}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Target:
    """What to evaluate: a model (spec or directory) under a run config."""

    name: str
    model: str
    version: int | None


def targets_of(run_dir: Path, cfg: RunConfig, *, initial: bool, every: bool) -> list[Target]:
    """The policies of a run directory to evaluate (initial first, final last)."""
    out = [Target("initial", cfg.model, 0)] if initial else []
    if every:
        out += [Target(p.name, str(p), v) for v, p in policies.published(run_dir)]
    final = policies.policy_dir(run_dir, "final")
    if final.is_dir():
        out.append(Target("final", str(final), policies.policy_version(final)))
    elif not every:
        kept = policies.latest(run_dir)
        if kept is None:
            raise ConfigError(f"{run_dir}: holds no policy (policies/final or a publication)")
        out.append(Target(kept[1].name, str(kept[1]), kept[0]))
    return out


def evaluate(
    cfg: RunConfig, target: Target, work_dir: Path, *, tasks: list[str], instances: int,
    concurrency: int, hide: tuple[Path, ...] = (),
) -> EvalResult:  # fmt: skip
    """Run `instances` held-out instances of every task in `tasks` against `target`."""
    from gyre.runtime.cell.engine_host import EngineHost

    fsafe.fresh_dir(work_dir, MADE_BY)  # an earlier evaluation of this policy: from nothing
    ensure_engine_key()  # the engine takes a key; its harnesses never see it
    engine = EngineHost(target.model, cfg.engine, work_dir / "engine.log", version=0)
    engine.spawn()
    try:
        url = engine.wait_ready(cfg.timeouts.startup_s)
        run_cfg = dataclasses.replace(cfg, model=target.model)
        t0 = time.time()
        verdicts = asyncio.run(
            _run_all(run_cfg, work_dir, url, tasks, instances, concurrency, hide)
        )
    finally:
        engine.stop()
    rewards = {x: v.reward if v.usable else None for x, v in verdicts.items()}
    tests = {x: v.tests for x, v in verdicts.items()}
    return EvalResult(target.name, target.version, target.model, rewards, time.time() - t0, tests)


async def _run_all(
    cfg: RunConfig, work_dir: Path, url: str, tasks: list[str], instances: int, concurrency: int,
    hide: tuple[Path, ...],
) -> dict[str, VerdictRecord]:  # fmt: skip
    from gyre.runtime.proxy_node.node import ExecutionHost

    host = ExecutionHost(cfg, work_dir, hide)
    await host.start({"e0": url})
    total, finished = len(tasks) * instances, [0]

    def done(eid: str, verdict: VerdictRecord) -> None:
        finished[0] += 1
        shown = "excluded" if not verdict.usable else f"reward {verdict.reward:.3f}"
        print(f"gyre eval: {work_dir.name} {finished[0]}/{total} {eid} {shown}",
              file=sys.stderr, flush=True)  # fmt: skip

    try:
        ran = await run_heldout(host, host.suite, tasks, instances=instances,
                                concurrency=concurrency, prefix="eval", engine="e0", done=done)  # fmt: skip
    finally:
        host.stop()
    return ran.verdicts


def run_eval(
    target: str, *, config: str | None, tasks: list[str] | None, instances: int,
    initial: bool, every: bool, concurrency: int | None, out: str | None,
    overrides: Sequence[str] = (),
) -> list[EvalResult]:  # fmt: skip
    """The `gyre eval` command: resolve the target, evaluate, write RUN_DIR/eval.json."""
    path = Path(target)
    run_dir = path if (path / "config.yaml").is_file() else None
    config_file: Path | None  # what the evaluation reads, apart from its outputs
    if run_dir is not None:
        config_file = Path(config) if config else run_dir / "config.yaml"
        cfg = load_run_config(config_file, overrides)
        todo = targets_of(run_dir, cfg, initial=initial, every=every)
    else:
        cfg = load_run_config(config or DEFAULT_CONFIG, overrides)
        config_file = Path(config) if config else None  # the shipped template: not the user's
        name = path.resolve().name if path.is_dir() else target
        todo = [Target(fsafe.safe_name(name), str(path.resolve()) if path.is_dir() else target,
                       None)]  # fmt: skip
    cfg, names = heldout(cfg, tasks)
    for t in todo:
        check_model(t.model)
        cfg.engine.check_machine(t.model)
    base = _work_base(out, run_dir, cfg, config_file, todo)
    limit = concurrency or cfg.engine.max_batch_size
    hide = (base,) + ((run_dir,) if run_dir is not None else ())  # the run's policies, trace
    from gyre import zygote

    # one import of the engine's code for every policy (unless this process has a zygote)
    ours = (
        cfg.engine.embedded_on_cpu and cfg.engine.zygote and len(todo) > 1 and not zygote.active()
    )
    if ours:
        zygote.on_demand("gyre.rollout.server:preload")
    try:
        results = [evaluate(cfg, t, base / t.name, tasks=names, instances=instances,
                            concurrency=limit, hide=hide) for t in todo]  # fmt: skip
    finally:
        if ours:
            zygote.close()
    if run_dir is not None:
        with fsafe.writing(run_dir / EVAL_FILE):
            _merge(run_dir / EVAL_FILE, results, names, instances)
        _track(cfg, run_dir, results)
    return results


def _work_base(
    out: str | None,
    run_dir: Path | None,
    cfg: RunConfig,
    config: Path | None,
    todo: list[Target],
) -> Path:
    """The directory of the targets' work directories, each made (or its own earlier one
    emptied) before any engine starts; `--out` and RUN_DIR/eval checked apart from every
    input first."""
    base = Path(out) if out is not None else run_dir / "eval" if run_dir is not None else None
    if base is None:  # a new one: apart from every input
        with fsafe.writing(Path(os.environ.get("TMPDIR", "/tmp"))):
            base = fsafe.make_temp_dir("gyre-eval-")
    else:
        inputs = config_inputs(cfg, config) | (run_inputs(run_dir) if run_dir else {})
        for t in todo:
            if Path(t.model).is_dir():
                inputs[f"the model {t.name}"] = Path(t.model)
        fsafe.check_outputs_apart({"--out" if out else "the eval directory": base}, inputs)
    with fsafe.writing(base):
        for t in todo:
            fsafe.fresh_dir(base / t.name, MADE_BY)
    return base


def run_inputs(run_dir: Path) -> dict[str, Path]:
    """What a run directory holds that commands read and must never write over: its config,
    trace, policies and checkpoints (keyed by what to call them in a message)."""
    from gyre.runtime.shared.checkpoint import CHECKPOINTS

    return {"the run's config": run_dir / "config.yaml", "the run's trace": run_dir / "trace.h5",
            "the run's policies": run_dir / policies.POLICIES,
            "the run's checkpoints": run_dir / CHECKPOINTS}  # fmt: skip


def _track(cfg: RunConfig, run_dir: Path, results: list[EvalResult]) -> None:
    """Send the results to the run's trackers (its `tracking:`), against policy versions."""
    t = cfg.tracking
    if not (t.tensorboard.enabled or t.wandb.enabled or t.mlflow.enabled):
        return
    from gyre.config import to_dict
    from gyre.tracking import open_tracker

    with open_tracker(t, run_dir, run_config=to_dict(cfg)) as tracker:
        for r in results:
            if r.version is not None:
                d = r.to_dict()
                tracker.log_eval(r.version, {"reward_mean": d["mean"], "reward_std": d["std"],
                                             "scored": d["n"], "excluded": d["excluded"]})  # fmt: skip


def _merge(path: Path, results: list[EvalResult], tasks: list[str], instances: int) -> None:
    """Add (or replace, by name) these results in a run's eval.json."""
    data = json.loads(path.read_text()) if path.exists() else {"results": []}
    fresh = {r.name for r in results}
    kept = [r for r in data["results"] if r["name"] not in fresh]
    extra = {"tasks": tasks, "instances": instances, "t": time.time()}
    data["results"] = kept + [{**r.to_dict(), **extra} for r in results]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def load_results(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluations recorded for a run (eval.json), oldest first."""
    path = run_dir / EVAL_FILE
    return list(json.loads(path.read_text())["results"]) if path.exists() else []
