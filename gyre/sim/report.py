"""Summaries of simulation runs: totals, per-step times, timeline, staleness, lower bound.

A `SimResult` is what one simulated run measured (`Simulator.run` returns it; the
simulator fills it from its records in `gyre.sim.simulator.summarize`). `table` formats
several results for the terminal, `to_json` for scripts and plots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    """Executions launched (N + k per group under oversampling, less the withdrawn)."""
    cancelled: int = 0
    """Surplus executions cancelled once their group had its N members (oversampling)."""
    withdrawn: int = 0
    """Surplus executions withdrawn from the queue before they launched (oversampling)."""
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
