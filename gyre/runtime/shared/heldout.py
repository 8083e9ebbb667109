"""The held-out set and the one way to run it: `gyre eval` and validation while training.

`heldout(cfg, tasks)` resolves what a held-out evaluation runs (the eval suite, or the
training suite's tasks on held-out seeds) and refuses what it cannot; `run_heldout` runs
`instances` held-out instances of each task on an `ExecutionHost` (the object a run's proxy
node drives), `concurrency` at a time, each execution scored by the host's evaluator exactly
as a training execution is. Both callers use these two functions:

* `gyre eval` (gyre.runtime.evaluation): its own engine, every call routed to it;
* a run's proxy node on `msg.Evaluate` (eval.every_steps): the run's rollout engines, the
  router choosing a live one for each call (a switch to training reroutes them like any
  other execution's), the ids marked as evaluation (`is_evaluation`) so their calls never
  reach the coordinator's trace or a training batch.

    cfg, names = heldout(cfg, None)
    ran = await run_heldout(host, suite, names, instances=16, concurrency=4, prefix="eval")
    ran.rewards   # execution id -> reward (None: excluded)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gyre.errors import ConfigError
from gyre.tasks.suite import heldout_seed

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig
    from gyre.runtime.shared.messages import VerdictRecord
    from gyre.tasks.suite import TaskSuite

EVAL_ID = "eval-"
"""Every evaluation execution's id starts with this; training executions' ids never do."""


def is_evaluation(execution_id: str) -> bool:
    """Is this an evaluation execution (never journaled, never trained)?"""
    return execution_id.startswith(EVAL_ID)


@dataclass(slots=True)
class HeldoutRun:
    """What one held-out evaluation's executions did."""

    verdicts: dict[str, VerdictRecord] = field(default_factory=dict)  # id -> verdict
    transcripts: dict[str, dict[str, Any]] = field(default_factory=dict)  # the first `keep`
    versions: set[int] = field(default_factory=set)  # policy versions that served its calls
    engines: set[str] = field(default_factory=set)  # engines that served them

    @property
    def rewards(self) -> dict[str, float | None]:
        """Execution id -> reward; None: excluded (no valid score)."""
        return {x: v.reward if v.usable else None for x, v in self.verdicts.items()}


async def run_heldout(
    host: Any, suite: TaskSuite, tasks: list[str], *, instances: int,
    concurrency: int, prefix: str, engine: str | None = None, keep: int = 0,
    done: Callable[[str, VerdictRecord], None] | None = None,
) -> HeldoutRun:  # fmt: skip
    """Run held-out instances 0..instances-1 of every task on `host` (an `ExecutionHost`).

    Ids are `{prefix}-{task}-{k}` (`prefix` starts with `EVAL_ID`); `engine`: route every
    call there (None: the router picks a live engine); `keep`: decode the transcripts of the
    first `keep` executions (in id order); `done(id, verdict)` as each one is scored."""
    assert is_evaluation(f"{prefix}-"), prefix  # ids `{prefix}-...` are evaluations
    gate = asyncio.Semaphore(concurrency)
    out = HeldoutRun()
    ids = [(t, k, f"{prefix}-{t}-{k}") for t in tasks for k in range(instances)]
    kept = {eid for _, _, eid in ids[:keep]}

    def closed(eid: str) -> Callable[[Any], None]:
        def see(tree: Any) -> None:
            if tree is None:
                return
            out.versions.update(int(n.policy_version) for n in tree.nodes)
            out.engines.update(str(n.engine_id) for n in tree.nodes)
            if eid in kept:
                out.transcripts[eid] = host.read_transcript(tree)

        return see

    async def one(task_name: str, k: int, eid: str) -> None:
        task = suite[task_name].instantiate(heldout_seed(k))
        async with gate:
            _, verdict = await host.execute(eid, task, engine, closed=closed(eid))
        out.verdicts[eid] = verdict
        if done is not None:
            done(eid, verdict)

    await asyncio.gather(*(one(t, k, eid) for t, k, eid in ids))
    out.verdicts = {eid: out.verdicts[eid] for _, _, eid in ids}  # in id order
    out.transcripts = {eid: out.transcripts[eid] for _, _, eid in ids if eid in out.transcripts}
    return out


def heldout(cfg: RunConfig, tasks: list[str] | None) -> tuple[RunConfig, list[str]]:
    """The config an evaluation runs (the held-out suite and tasks) and the task names.

    `eval.suite` when the run has one (its `eval.tasks`, else all of it); otherwise the
    training suite's tasks (`harness.tasks`), each on held-out seeds, which only a task with
    variables has: a task without is a single instance training runs, so it is refused
    rather than scored as held-out. `tasks` (`--tasks`) replaces the task list."""
    from gyre.runtime.shared.harness import check_adapter, check_sandbox, load_tasks

    own = cfg.eval.suite is not None
    suite = cfg.eval.suite if own else cfg.harness.suite
    chosen = list(tasks or (cfg.eval.tasks if own else cfg.harness.tasks))
    run_cfg = dataclasses.replace(
        cfg,
        harness=dataclasses.replace(cfg.harness, suite=suite, tasks=chosen),  # type: ignore[arg-type]
    )
    check_adapter(run_cfg, program=True)
    check_sandbox(run_cfg.harness.sandbox, run_cfg.harness.apptainer_image)
    try:
        loaded, names = load_tasks(run_cfg)
    except ConfigError as e:
        key = "--tasks" if tasks else ("eval.tasks" if own else "harness.tasks")
        raise ConfigError(f"{key}: {e}".replace("harness.tasks: ", "", 1)) from None
    fixed = [n for n in names if not own and not loaded[n].variables]
    if fixed:
        raise ConfigError(
            f"harness.suite {suite!r}: task(s) {', '.join(fixed)} have no variables, so their one "
            "instance is a training row and held-out seeds would re-run it; allowed: "
            "eval.suite=<a held-out suite> (e.g. eval.suite=builtin to score them anyway), or "
            "--tasks with tasks that have variables"
        )
    return run_cfg, names
