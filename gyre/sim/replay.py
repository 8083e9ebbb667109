"""Trace replay: fit the simulator's workload and costs from a recorded `gyre run`.

`gyre sim --replay RUN_DIR|TRACE` reads the run's HDF5 trace (docs/trace-format.md) and its
config (the run meta), and fits:

* the workload: per execution its run time (open to its harness's end, or the harness
  timeout; a trace written before runs recorded `t_ended`: to its last model call, which
  leaves the harness's last tool work out of the slot's time), evaluation time (to its
  close), model calls, training tokens (the flat tokens of at most J_max of its
  trajectories), outcome (harness timeout, excluded by the overall budget); per group
  (query) the span of its executions;
* the costs: switch seconds per direction (the `roles` timeline's transitions), publication
  seconds (`publish` events), gradient throughput and prepass share (the `steps` table's
  `gradient_s` / `prepass_s` over the admitted groups' tokens, from `admit` events),
  tokens per micro-step, the optimizer update (wall time of a step's training beyond its
  passes), the start-up before the first dispatch.

The replay simulates the run's own topology on the *recorded* groups (drawn with
replacement, or with `--in-order` in the order the run dispatched them), so its wall time
can be compared with the run's; `fit_workload` also gives the
parametric `WorkloadConfig` that `nominal_stats` compares with the recorded figures. Any
topology can be simulated on the fit by overriding template keys. A file that is not a
Gyre trace of a run is a `StoreError` naming it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gyre.config import load
from gyre.errors import StoreError
from gyre.schedule.config import Config, ScheduleConfig
from gyre.sim.workload import HOUR, GroupSample
from gyre.trajectory.reader import trace_path
from gyre.vocabulary import Outcome, VerdictStatus

TREE_SAMPLE = 400  # executions whose call timings are read (trees hold every token)
TIMED_OUT_WORK = 100.0  # a recorded timeout's nominal work, in timeouts: beyond it at any load


@dataclass(slots=True)
class RecordedExecution:
    """One execution of the run, as the replay sees it."""

    group: str
    total_s: float
    """Open to close: run, then evaluation."""
    run_s: float
    eval_s: float
    calls: int
    tokens: float
    timed_out: bool
    valid: bool
    generation_s: float | None = None


@dataclass(slots=True)
class RecordedRun:
    """What a run's trace says about its workload, costs and result."""

    path: Path
    config: dict[str, Any]
    executions: list[RecordedExecution]
    steps: list[dict[str, float]]
    admitted: dict[int, list[str]]  # batch -> groups
    dispatch_order: dict[str, int] = field(default_factory=dict)  # group -> its position
    switch_to_train_s: list[float] = field(default_factory=list)
    switch_to_rollout_s: list[float] = field(default_factory=list)
    publish_s: list[float] = field(default_factory=list)
    startup_s: float = 0.0
    wall_s: float = 0.0

    def section(self, name: str) -> dict[str, Any]:
        value = self.config.get(name) or {}
        return value if isinstance(value, dict) else {}

    @property
    def schedule(self) -> ScheduleConfig:
        """The run's batch shape and dispatch (its `schedule:` section, policy keys aside)."""
        section, own = self.section("schedule"), ScheduleConfig.__dataclass_fields__
        return load(ScheduleConfig, {k: v for k, v in section.items() if k in own},
                    path="schedule")  # fmt: skip

    @property
    def group_size(self) -> int:
        return self.schedule.group_size

    @property
    def executions_per_group(self) -> int:
        """N + k: the executions each group ran (k: the run's oversampling)."""
        return self.schedule.executions_per_group

    def groups(self) -> dict[str, list[RecordedExecution]]:
        out: dict[str, list[RecordedExecution]] = {}
        for x in self.executions:
            out.setdefault(x.group, []).append(x)
        return out


def read_run(source: str | Path) -> RecordedRun:
    """Read a run directory or trace file; StoreError (one line) if it is not a run's trace."""
    from gyre.trajectory.reader import TraceReader

    path = trace_path(source)
    try:
        with TraceReader(path) as reader:
            return _read(reader, path)
    except (KeyError, ValueError, TypeError, OSError, yaml.YAMLError) as e:
        raise StoreError(f"{path}: not a readable Gyre run trace ({e})") from None


def _read(reader: Any, path: Path) -> RecordedRun:
    config = yaml.safe_load(str(reader.run_meta.get("config", ""))) or {}
    if not isinstance(config, dict) or "schedule" not in config:
        raise StoreError(f"{path}: the trace carries no run config (not written by `gyre run`)")
    harness = config.get("harness") or {}
    timeout_s = float(harness.get("harness_timeout_s", math.inf))
    j_max = int((config.get("train") or {}).get("j_max", 5))
    rows = _step_rows(reader.rows("steps"))
    if not rows:
        raise StoreError(f"{path}: the run recorded no training step; nothing to replay")
    run = RecordedRun(path=path, config=config, executions=[], steps=rows, admitted={})
    t0 = rows[0]["t"] - rows[0]["elapsed_s"]
    run.wall_s = rows[-1]["elapsed_s"]
    dispatched = sorted((float(g["t_dispatch"]), str(g["group_id"])) for g in reader.rows("groups"))
    run.startup_s = max(0.0, dispatched[0][0] - t0) if dispatched else 0.0
    for _, group in dispatched:
        run.dispatch_order.setdefault(group, len(run.dispatch_order))
    infos = [i for i in reader.executions() if i.closed]
    if not infos:
        raise StoreError(f"{path}: the run closed no execution; nothing to replay")
    sample = {i.execution_id for i in infos[:: max(1, len(infos) // TREE_SAMPLE)]}
    for info in infos:
        tree = reader.tree(info.execution_id) if info.execution_id in sample else None
        run.executions.append(_execution(info, tree, timeout_s, j_max))
    _fill_unsampled(run.executions)
    _read_events(reader, run)
    return run


def _step_rows(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for r in rows:
        steps.setdefault(int(r["step"]), {"t": float(r["t"])})[str(r["name"])] = float(r["value"])
    return [steps[k] for k in sorted(steps) if "elapsed_s" in steps[k]]


def _execution(info: Any, tree: Any, timeout_s: float, j_max: int) -> RecordedExecution:
    meta = info.meta
    timed_out = info.status == Outcome.TIMED_OUT.value
    total = float(info.t_close - info.t_open)
    gen = None
    run_s = min(total, timeout_s) if timed_out else _harness_s(meta, info)
    if tree is not None and len(tree):
        nodes = tree.nodes  # one per model call
        gen = sum(n.t_end - n.t_start for n in nodes)
        if math.isnan(run_s):  # a trace without the harness's end: its last model call
            run_s = max(n.t_end for n in nodes) - info.t_open
    leaves = max(1, info.num_leaves)
    return RecordedExecution(
        group=str(meta.get("group", info.execution_id.split("-")[0])),
        total_s=total,
        run_s=run_s,
        eval_s=total - run_s if not math.isnan(run_s) else math.nan,
        calls=info.num_nodes,
        tokens=info.flat_tokens * min(1.0, j_max / leaves),
        timed_out=timed_out,
        valid=meta.get("verdict") == VerdictStatus.SCORED.value,
        generation_s=gen,
    )


def _harness_s(meta: Any, info: Any) -> float:
    """Open to the harness's end (`t_ended`, recorded since 2026-12-04): the execution's slot
    is busy until then, through its last tool work after its last model call; NaN without it."""
    ended = meta.get("t_ended")
    if isinstance(ended, (int, float)) and info.t_open <= ended <= info.t_close:
        return float(ended - info.t_open)
    return math.nan


def _fill_unsampled(executions: list[RecordedExecution]) -> None:
    """Executions whose calls were not read get the sampled mean evaluation time."""
    known = [x.eval_s for x in executions if not math.isnan(x.eval_s)]
    gap = statistics.fmean(known) if known else 0.0
    for x in executions:
        if math.isnan(x.run_s):
            x.eval_s = min(gap, x.total_s)
            x.run_s = x.total_s - x.eval_s
        elif math.isnan(x.eval_s):
            x.eval_s = x.total_s - x.run_s


def _read_events(reader: Any, run: RecordedRun) -> None:
    import json

    for e in reader.rows("events"):
        try:
            detail = json.loads(e["detail"]) if e["detail"] else {}
        except ValueError:
            continue
        if e["kind"] == "admit":
            run.admitted.setdefault(int(detail["batch"]), []).append(str(detail["group"]))
        elif e["kind"] == "publish" and "seconds" in detail:
            run.publish_s.append(float(detail["seconds"]))
    for r in reader.rows("roles"):
        seconds = float(r["t_end"]) - float(r["t_start"])
        if r["role"] == "to_train" and seconds >= 0:
            run.switch_to_train_s.append(seconds)
        elif r["role"] == "to_rollout" and seconds >= 0:
            run.switch_to_rollout_s.append(seconds)


# ---------------------------------------------------------------------- the fit


@dataclass(slots=True)
class Fit:
    """A recorded run turned into simulator inputs, and the run's own figures."""

    template: dict[str, Any]
    """SimConfig data: the run's topology, the parametric workload, the fitted costs."""
    groups: list[GroupSample]
    """The recorded groups, for the empirical replay."""
    recorded: dict[str, float]
    """The run's own figures (seconds, shares, counts)."""


def fit(run: RecordedRun) -> Fit:
    """Topology, workload and costs of a recorded run."""
    return Fit(
        template={
            "steps": len(run.steps),
            "seed": 0,
            "policy": _policy(run),
            "scheduler": _scheduler(run),
            "policies": {_policy(run): _policy_spec(run)},
            "workload": fit_workload(run),
            "costs": fit_costs(run),
        },
        groups=empirical_groups(run),
        recorded=recorded_figures(run),
    )


def _policy(run: RecordedRun) -> str:
    return str(run.section("schedule").get("policy", "elastic"))


def _scheduler(run: RecordedRun) -> dict[str, Any]:
    topo = run.section("topology")
    cells = int(topo.get("cells", 1))
    out: dict[str, Any] = run.schedule.shape()
    stages = int((run.section("train").get("parallel") or {}).get("pipeline", 1))  # the run's
    out.update(nodes=cells, cells=cells, train_layout_nodes=1,
               standalone_nodes=int(topo.get("standalone_engines", 0)),
               window=run.schedule.window_for(stages))  # fmt: skip
    return out


def _policy_spec(run: RecordedRun) -> dict[str, Any]:
    sched = run.section("schedule")
    streaming = sched.get("streaming")
    if streaming is None:
        streaming = _policy(run) == "elastic"
    return {"streaming": bool(streaming), "train_cells": int(sched.get("train_cells", 1))}


def fit_workload(run: RecordedRun) -> dict[str, Any]:
    """The parametric workload (`workload:` keys) closest to the recorded executions."""
    harness = run.section("harness")
    timeout_s = float(harness.get("harness_timeout_s", 4 * HOUR))
    overall_s = max(timeout_s, float(harness.get("overall_timeout_s", timeout_s)))
    groups = [g for g in run.groups().values() if len(g) == run.executions_per_group]
    hard = [g for g in groups if 2 * sum(x.timed_out for x in g) >= len(g)]
    easy = [g for g in groups if g not in hard] or groups
    logs = [np.log([max(x.run_s, 1e-3) for x in g]) for g in easy]
    centers = [float(v.mean()) for v in logs]
    spread = np.concatenate([v - c for v, c in zip(logs, centers)]) if logs else np.zeros(1)
    run_h = sum(x.run_s for x in run.executions) / HOUR
    gen = [(x.generation_s, x.run_s) for x in run.executions if x.generation_s is not None]
    rates = [x.tokens / (x.run_s / HOUR) for x in run.executions if x.run_s > 0 and x.tokens > 0]
    evals = [x.eval_s for x in run.executions if x.valid]
    return {
        "query_median_h": math.exp(statistics.median(centers)) / HOUR if centers else 1.0,
        "query_sigma": statistics.pstdev(centers) if len(centers) > 1 else 0.0,
        "hard_query_prob": len(hard) / len(groups) if groups else 0.0,
        "hard_query_factor": 3.0,
        "execution_sigma": float(spread.std()),
        "tail_prob": 0.0,
        "generation_share": min(1.0, sum(g for g, _ in gen) / max(1e-9, sum(r for _, r in gen)))
        if gen
        else 0.6,
        "harness_timeout_h": timeout_s / HOUR,
        "overall_timeout_h": overall_s / HOUR,
        "eval_minutes": (statistics.fmean(evals) if evals else 0.0) / 60.0,
        "eval_fail_prob": 0.0,
        "train_tokens_per_hour": sum(x.tokens for x in run.executions) / max(run_h, 1e-12),
        "tokens_sigma": statistics.pstdev(np.log(rates).tolist()) if len(rates) > 1 else 0.0,
    }


def fit_costs(run: RecordedRun) -> dict[str, Any]:
    """Switch, publication, training and start-up costs (`costs:` keys) of the run."""
    tokens = _step_tokens(run)
    steps = run.steps
    gradient_s = sum(s.get("gradient_s", 0.0) for s in steps)
    prepass_s = sum(s.get("prepass_s", 0.0) for s in steps)
    microsteps = sum(s.get("microsteps", 0.0) for s in steps)
    # the update's own wall time (reduce to updated), recorded since 2026-12; older traces:
    # the training window beyond its passes, which also holds a streaming batch's waits for
    # its late groups (an Elastic run's update came out ~25x its modelled seconds)
    beyond = [s["update_s"] for s in steps if math.isfinite(s.get("update_s", math.nan))] or [
        max(0.0, s["train_wall_s"] - (s.get("prepass_s", 0.0) + s.get("gradient_s", 0.0))
            / max(1.0, min(s.get("microsteps", 1.0), s.get("train_cells", 1.0))))
        for s in steps if math.isfinite(s.get("train_wall_s", math.nan))
    ]  # fmt: skip
    return {
        "switch_to_train_s": _mean(run.switch_to_train_s, 0.0),
        "switch_to_rollout_s": _mean(run.switch_to_rollout_s, 0.0),
        "publish_s": _mean(run.publish_s, 0.0),
        "update_s": statistics.median(beyond) if beyond else 0.0,
        "pipeline_stages": 1,
        "train_tokens_per_node_s": sum(tokens) / gradient_s if gradient_s > 0 else 1e9,
        "prepass_ratio": prepass_s / gradient_s if gradient_s > 0 else 1 / 3,
        "microstep_tokens": sum(tokens) / microsteps if microsteps > 0 else 0.0,
        "reroute_penalty_s": 0.0,
        "startup_s": run.startup_s,
    }


def _step_tokens(run: RecordedRun) -> list[float]:
    """Training tokens of each step: its admitted groups' valid executions."""
    by_group: dict[str, float] = {}
    for x in run.executions:
        if x.valid:
            by_group[x.group] = by_group.get(x.group, 0.0) + x.tokens
    if not run.admitted:  # a trace without admit events: spread the total evenly
        total = sum(by_group.values())
        return [total / max(1, len(by_group)) * run.schedule.batch_groups
                for _ in run.steps]  # fmt: skip
    return [
        sum(by_group.get(g, 0.0) for g in run.admitted.get(b, [])) for b in range(len(run.steps))
    ]


def empirical_groups(run: RecordedRun) -> list[GroupSample]:
    """Every complete recorded group, as the simulator samples them, in dispatch order."""
    harness = run.section("harness")
    timeout_s = float(harness.get("harness_timeout_s", math.inf))
    overall_s = float(harness.get("overall_timeout_s", math.inf))
    out = []
    order = run.dispatch_order
    for _, g in sorted(run.groups().items(), key=lambda kv: order.get(kv[0], len(order))):
        if len(g) != run.executions_per_group:
            continue
        # a timeout's work goes on past its timeout at any load (an engine below its limit
        # runs faster than nominal, and 1.001 x the timeout would then complete in time);
        # its tokens grow with it, so the share done at the timeout is what it recorded
        more = [TIMED_OUT_WORK if x.timed_out else 1.0 for x in g]
        nominal = [timeout_s * m if x.timed_out else x.run_s for x, m in zip(g, more)]
        evals = [x.eval_s if x.valid else overall_s + 1.0 for x in g]  # excluded: past it
        out.append(GroupSample(nominal_s=np.array(nominal), eval_s=np.array(evals),
                               tokens=np.array([x.tokens * m for x, m in zip(g, more)])))  # fmt: skip
    if not out:
        raise StoreError(
            f"{run.path}: no complete group of {run.executions_per_group} executions to replay"
        )
    return out


def recorded_figures(run: RecordedRun) -> dict[str, float]:
    """The run's own figures, in the units `figures_of` reports a simulation in."""
    xs = run.executions
    spans = [
        max(x.run_s for x in g) for g in run.groups().values() if len(g) == run.executions_per_group
    ]
    return {
        "mean_execution_s": statistics.fmean(x.run_s for x in xs),
        "mean_query_s": statistics.fmean(spans) if spans else math.nan,
        "harness_timeouts": sum(x.timed_out for x in xs) / len(xs),
        "overall_timeouts": sum(not x.valid for x in xs) / len(xs),
        "calls_per_execution": statistics.fmean(x.calls for x in xs),
        "tokens_per_execution": statistics.fmean(x.tokens for x in xs),
        "eval_s": statistics.fmean(x.eval_s for x in xs),
        "wall_s": run.wall_s,
        "steps": float(len(run.steps)),
        "executions": float(len(xs)),
    }


def _mean(values: list[float], default: float) -> float:
    return statistics.fmean(values) if values else default


# ---------------------------------------------------------------------- the report

FIGURES = (  # (key, label) of the figures the run, the fit and the replay all have
    ("mean_execution_s", "mean execution s"),
    ("mean_query_s", "mean query (group span) s"),
    ("harness_timeouts", "harness timeouts"),
    ("overall_timeouts", "overall timeouts (excluded)"),
)


def fit_figures(fit: Fit, groups: int = 2000, seed: int = 1) -> dict[str, float]:
    """The parametric workload's own figures (at the reference load), in seconds."""
    from gyre.sim.workload import WorkloadConfig, nominal_stats

    n = Config(**fit.template["scheduler"]).executions_per_group
    stats = nominal_stats(WorkloadConfig(**fit.template["workload"]), n, groups, seed)
    return {"mean_execution_s": stats["mean_execution_h"] * HOUR,
            "mean_query_s": stats["mean_query_h"] * HOUR,
            "harness_timeouts": stats["harness_timeouts"],
            "overall_timeouts": stats["overall_timeouts"]}  # fmt: skip


def replay_figures(result: Any) -> dict[str, float]:
    w = result.workload
    return {"mean_execution_s": w.get("mean_execution_h", math.nan) * HOUR,
            "mean_query_s": w.get("mean_query_h", math.nan) * HOUR,
            "harness_timeouts": w.get("harness_timeouts", math.nan),
            "overall_timeouts": w.get("overall_timeouts", math.nan)}  # fmt: skip


def format_replay(fit: Fit, replays: list[Any], parametric: list[Any]) -> str:
    """The fit beside the run's own figures, and the replay's wall time beside the run's."""
    rec, costs, sched = fit.recorded, fit.template["costs"], fit.template["scheduler"]
    fitted = fit_figures(fit)
    got = replay_figures(replays[0])
    lines = [
        f"replay: {sched['cells']} cells x {sched.get('concurrency_per_cell')} slots, "
        f"{sched.get('standalone_nodes', 0)} standalone, N={sched.get('group_size')}, "
        f"B={sched.get('batch_groups')}, φ={sched.get('phi')}, μ={sched.get('mu')}, "
        f"{fit.template['policy']}, {fit.template['steps']} steps, "
        f"{int(rec['executions'])} executions in {len(fit.groups)} complete groups",
        f"{'figure':<30}{'run':>12}{'fit':>12}{'replay':>12}",
    ]
    for key, label in FIGURES:
        lines.append(f"{label:<30}{_v(rec[key]):>12}{_v(fitted[key]):>12}{_v(got[key]):>12}")
    for label, value in (
        ("calls per execution", rec["calls_per_execution"]),
        ("training tokens per execution", rec["tokens_per_execution"]),
        ("evaluation s", rec["eval_s"]),
        ("switch to train s", costs["switch_to_train_s"]),
        ("switch to rollout s", costs["switch_to_rollout_s"]),
        ("publication s", costs["publish_s"]),
        ("optimizer update s", costs["update_s"]),
        ("gradient tokens/s per cell", costs["train_tokens_per_node_s"]),
        ("prepass / gradient cost", costs["prepass_ratio"]),
        ("tokens per micro-step", costs["microstep_tokens"]),
        ("start-up s", costs["startup_s"]),
    ):
        lines.append(f"{label:<30}{_v(value):>12}{'(fitted)':>12}")
    lines.append(wall_line("replay (recorded groups)", rec["wall_s"], replays))
    if parametric:
        lines.append(wall_line("simulation of the fit", rec["wall_s"], parametric))
    return "\n".join(lines)


def wall_line(what: str, run_s: float, results: list[Any]) -> str:
    walls = [r.total_h * HOUR for r in results]
    mean = statistics.fmean(walls)
    return (f"wall time: run {run_s:.1f} s, {what} {mean:.1f} s over {len(walls)} seeds "
            f"({min(walls):.1f}-{max(walls):.1f}), error {mean / run_s - 1:+.1%}")  # fmt: skip


def _v(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "-"
    if abs(x) < 1 and x != 0:
        return f"{x:.3f}"
    return f"{x:.1f}" if abs(x) < 1e4 else f"{x:.3g}"
