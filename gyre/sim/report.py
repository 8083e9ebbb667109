"""Summaries of simulation runs: totals, per-step times, timeline, staleness, lower bound.

`summarize(sim, wall_s)` turns a finished `Simulator` into a `SimResult`; `table` and
`comparison` format several results for the terminal, `to_json` for scripts and plots.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gyre.schedule.plan import expected_staleness
from gyre.sim.workload import HOUR

if TYPE_CHECKING:
    from gyre.sim.simulator import Simulator


@dataclass(kw_only=True, slots=True)
class SimResult:
    """What one simulated run measured."""

    policy: str
    phi: float
    mu: int
    steps: int
    total_h: float
    step_end_h: list[float]
    mean_staleness: float
    expected_staleness: float
    ideal_h: float
    utilization: float
    train_share: list[float]
    executions: int
    reroutes: int
    switches: int
    wasted_switches: int
    workload: dict[str, float]
    wall_s: float
    timeline: list[tuple[float, int, str]] = field(default_factory=list)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not timeline:
            out.pop("timeline")
        return out


def summarize(sim: Simulator, wall_s: float) -> SimResult:
    total = sim.step_end[sim.steps - 1]
    sc = sim.sched_config
    consumed = [g for b in range(sim.steps) for g in sim.batch_groups.get(b, [])]
    return SimResult(
        policy=sim.policy.name,
        phi=sc.phi,
        mu=sc.mu,
        steps=sim.steps,
        total_h=total / HOUR,
        step_end_h=[t / HOUR for t in sim.step_end[: sim.steps]],
        mean_staleness=statistics.fmean(sim.staleness) if sim.staleness else 0.0,
        expected_staleness=expected_staleness(sc.extra_groups / sc.batch_groups, sc.mu),
        ideal_h=_ideal_s(sim, consumed) / HOUR,
        utilization=_ideal_s(sim, consumed) / total if total else 0.0,
        train_share=_train_share(sim.timeline, sc.cells, total),
        executions=sum(1 for t in sim.launch_t if t >= 0),
        reroutes=sim.reroutes,
        switches=sum(1 for _, _, role in sim.timeline if role in ("to_train", "to_rollout")),
        wasted_switches=sim.scheduler.wasted_switches,
        workload=_workload_stats(sim),
        wall_s=wall_s,
        timeline=list(sim.timeline),
    )


def _ideal_s(sim: Simulator, groups: list[int]) -> float:
    """Perfect overlap at the same budget: (rollout + training node-seconds) / nodes.

    Rollout counts each consumed execution's work at the reference load (every engine
    full), training its tokens' gradient pass and prepass at the node throughput."""
    sc, costs = sim.sched_config, sim.config.costs
    n = sc.group_size
    slot_s = tokens = 0.0
    for g in groups:
        for x in range(g * n, (g + 1) * n):
            slot_s += min(sim.nominal[x], sim.timeout_s)
            if sim.valid[x]:
                tokens += sim.tokens[x]
    rollout_node_s = slot_s * sc.nodes_per_cell / sc.concurrency_per_cell
    train_node_s = tokens * (1 + costs.prepass_ratio) / costs.train_tokens_per_node_s
    return (rollout_node_s + train_node_s) / (sc.nodes + sc.standalone_nodes)


def _train_share(timeline: list[tuple[float, int, str]], cells: int, end: float) -> list[float]:
    """Per cell, the share of [0, end] spent outside ROLLOUT (training or switching)."""
    spent = [0.0] * cells
    last: list[tuple[float, str]] = [(0.0, "rollout")] * cells
    for t, c, role in sorted(timeline, key=lambda r: r[0]):
        t = min(t, end)
        since, prev = last[c]
        if prev != "rollout":
            spent[c] += t - since
        last[c] = (t, role)
    for c, (since, prev) in enumerate(last):
        if prev != "rollout":
            spent[c] += end - since
    return [s / end if end else 0.0 for s in spent]


def _workload_stats(sim: Simulator) -> dict[str, float]:
    n = sim.sched_config.group_size
    ended = [x for x, t in enumerate(sim.end_t) if t >= 0]
    if not ended:
        return {}
    runs = [sim.end_t[x] - sim.launch_t[x] for x in ended]
    spans = []
    for g in range(len(sim.evaluated)):
        xs = range(g * n, (g + 1) * n)
        if all(sim.end_t[x] >= 0 for x in xs):
            spans.append(max(sim.end_t[x] for x in xs) - min(sim.launch_t[x] for x in xs))
    return {
        "mean_execution_h": statistics.fmean(runs) / HOUR,
        "mean_query_h": statistics.fmean(spans) / HOUR if spans else 0.0,
        "queries_over_4h": sum(s >= 4 * HOUR - 1 for s in spans) / len(spans) if spans else 0.0,
        "harness_timeouts": sum(sim.outcome[x] == "harness_timeout" for x in ended) / len(ended),
        "overall_timeouts": sum(not sim.valid[x] for x in ended) / len(ended),
    }


def table(results: list[SimResult]) -> str:
    """A plain-text table of several runs, with ratios over the first Elastic run."""
    base = next((r for r in results if r.policy == "elastic"), results[0])
    lines = [
        f"{'policy':<10}{'φ':>6}{'μ':>4}{'steps':>7}{'hours':>9}{'h/step':>8}"
        f"{'x elastic':>10}{'E[d]':>7}{'(plan)':>7}{'ideal h':>9}{'util':>7}{'wall s':>8}"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<10}{r.phi:>6.2f}{r.mu:>4}{r.steps:>7}{r.total_h:>9.2f}"
            f"{r.total_h / r.steps:>8.3f}{r.total_h / base.total_h:>10.3f}"
            f"{r.mean_staleness:>7.2f}{r.expected_staleness:>7.2f}{r.ideal_h:>9.2f}"
            f"{r.utilization:>7.1%}{r.wall_s:>8.2f}"
        )
    for r in results:
        shares = " ".join(f"{s:.0%}" for s in r.train_share)
        lines.append(f"{r.policy:<10} training share per cell: {shares}")
    return "\n".join(lines)


def to_json(results: list[SimResult]) -> dict[str, Any]:
    """Totals per policy, ratios over Elastic, staleness and the ideal lower bound."""
    by = {r.policy: r for r in results}
    out: dict[str, Any] = {
        "policies": {
            r.policy: {
                "total_h": r.total_h,
                "phi": r.phi,
                "mu": r.mu,
                "mean_staleness": r.mean_staleness,
                "expected_staleness": r.expected_staleness,
                "ideal_h": r.ideal_h,
                "utilization": r.utilization,
                "train_share": r.train_share,
                "wall_s": r.wall_s,
                "workload": r.workload,
            }
            for r in results
        }
    }
    if "elastic" in by:
        e = by["elastic"].total_h
        out["speedup_over"] = {p: r.total_h / e for p, r in by.items() if p != "elastic"}
    return out
