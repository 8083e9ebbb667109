"""What-if sweeps: one simulation per point of a grid of template changes.

`gyre sim TEMPLATE --sweep KEY=V1,V2 [--sweep KEY=...]` runs every combination of the
values (the cartesian product) and prints one row per point and policy, the best (fewest
hours) of each policy marked, plus a plot. The keys an operator plans with keep the node
budget (cell nodes + standalone nodes) fixed:

| key | what changes |
|---|---|
| `cells` | number of cells over the same nodes; concurrency per cell scales with cell size |
| `nodes_per_cell` | the same, given as the cell size |
| `standalone_nodes` | standalone pool; the cells shrink to keep the budget (cell size kept) |
| `concurrency_per_cell` | executions one cell-sized engine serves |
| `phi`, `mu`, `phi_mu` (`0.5/3`) | boundary dispatch of every policy run |
| `staleness` | target E[d]; (φ, μ) per policy from `gyre plan` |

Any other dotted template key (`workload.harness_timeout_h`, `costs.switch_to_train_s`, ...)
is set as it is. Every point goes through the strict template loader, so a bad value is a
`ConfigError` naming the key and the point.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config import apply_overrides, load, parse_override
from gyre.errors import ConfigError
from gyre.schedule.config import POLICIES
from gyre.sim.config import SimConfig
from gyre.sim.report import SimResult

Sweep = list[tuple[str, list[Any]]]


@dataclass(slots=True)
class Point:
    """One grid point and what one policy measured there."""

    values: dict[str, Any]
    policy: str
    result: SimResult | None
    """None when the point is not a valid configuration (`error` says why)."""
    best: bool = False
    error: str = ""


def parse_sweeps(texts: list[str]) -> Sweep:
    """`KEY=V1,V2,...` per text; values are YAML scalars (`0.5/3` for `phi_mu`)."""
    out: Sweep = []
    for text in texts:
        key, sep, values = text.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--sweep {text!r}: allowed KEY=V1,V2,... (e.g. cells=4,8)")
        parsed = []
        for v in values.split(","):
            _, value = parse_override(f"x={v.strip()}")
            _check_planning_value(key.strip(), value)
            parsed.append(value)
        out.append((key.strip(), parsed))
    return out


_COUNTS = {"cells": 1, "nodes_per_cell": 1, "standalone_nodes": 0, "concurrency_per_cell": 1,
           "mu": 1}  # fmt: skip
"""The planning keys whose values are whole numbers, and their least allowed value."""


def _check_planning_value(key: str, value: Any) -> None:
    """A planning key's value is refused here, before any point runs (a dotted template key
    goes through the template loader instead)."""
    if key in _COUNTS:
        low = _COUNTS[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"--sweep {key}={value!r}; allowed: integers >= {low}")
    elif key in ("phi", "staleness"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ConfigError(f"--sweep {key}={value!r}; allowed: numbers >= 0")
    elif key == "phi_mu":
        phi, sep, mu = str(value).partition("/")
        try:
            ok = bool(sep) and float(phi) >= 0 and int(mu) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"--sweep phi_mu={value!r}; allowed: φ/μ with φ >= 0, μ >= 1, "
                              "e.g. 0.5/3")  # fmt: skip


def apply_point(data: dict[str, Any], key: str, value: Any, policies: list[str]) -> dict:
    """The template data with one swept key set (budget-keeping for the planning keys)."""
    out = copy.deepcopy(data)
    sched = out.setdefault("scheduler", {})
    nodes, cells = int(sched.get("nodes", 32)), int(sched.get("cells", 8))
    per_node = float(sched.get("concurrency_per_cell", 144)) / (nodes / cells)
    if key in ("cells", "nodes_per_cell"):
        new_cells = int(value) if key == "cells" else _divide(nodes, int(value), key)
        sched["cells"] = new_cells
        sched["concurrency_per_cell"] = max(1, round(per_node * nodes / new_cells))
    elif key == "standalone_nodes":
        budget = nodes + int(sched.get("standalone_nodes", 0))
        size = nodes // cells
        sched.update(standalone_nodes=int(value), nodes=budget - int(value))
        sched["cells"] = _divide(budget - int(value), size, key)
    elif key == "concurrency_per_cell":
        sched["concurrency_per_cell"] = value
    elif key in ("phi", "mu", "phi_mu"):
        phi, mu = _phi_mu(key, value)
        for p in policies:
            spec = out.setdefault("policies", {}).setdefault(p, {})
            spec.update({k: v for k, v in (("phi", phi), ("mu", mu)) if v is not None})
    elif key == "staleness":
        out["staleness"] = value
    else:
        out = apply_overrides(out, [f"{key}={value}"])
    return out


def run_sweep(
    data: dict[str, Any],
    sweeps: Sweep,
    policies: list[str],
    simulate: Callable[[list[tuple[SimConfig, str]]], list[SimResult]],
    name: str = "sweep",
) -> list[Point]:
    """Every point of the grid for every policy; the best point of each policy marked.

    `simulate` runs a list of (config, policy) and returns their results in order (the CLI
    spreads them over processes)."""
    if not sweeps:
        raise ConfigError("--sweep: give at least one KEY=V1,V2,...")
    points: list[Point] = []
    todo: list[tuple[SimConfig, str]] = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        values = {key: v for (key, _), v in zip(sweeps, combo)}
        try:
            point = data
            for key, v in values.items():
                point = apply_point(point, key, v, policies)
            cfg = load(SimConfig, point, path=name)
            for p in policies:
                cfg.scheduler_for(p)  # per-policy overrides must fit the point too
        except ConfigError as e:  # e.g. a standalone pool that is not whole cells
            points += [Point(values, p, None, error=str(e)) for p in policies]
            continue
        for p in policies:
            points.append(Point(values, p, None))
            todo.append((cfg, p))
    pending = [pt for pt in points if not pt.error]
    for pt, result in zip(pending, simulate(todo)):
        pt.result = result
    for p in policies:
        mine = [pt for pt in points if pt.policy == p and pt.result is not None]
        if not mine:
            raise ConfigError(f"--sweep: no valid point for {p}: {points[0].error}")
        min(mine, key=lambda pt: pt.result.total_h if pt.result else 0.0).best = True
    return points


def table(points: list[Point]) -> str:
    keys = list(points[0].values)
    width = {k: max(8, len(k) + 2) for k in keys}
    head = "".join(f"{k:>{width[k]}}" for k in keys)
    lines = [f"{head}{'policy':>10}{'hours':>9}{'h/step':>8}{'ideal h':>9}{'util':>7}"
             f"{'E[d]':>6}{'wasted':>8}  best"]  # fmt: skip
    for pt in points:
        r = pt.result
        cols = "".join(f"{_fmt(pt.values[k]):>{width[k]}}" for k in keys)
        if r is None:
            lines.append(f"{cols}{pt.policy:>10}  not run: {pt.error}")
            continue
        lines.append(
            f"{cols}{pt.policy:>10}{r.total_h:>9.2f}{r.total_h / r.steps:>8.3f}{r.ideal_h:>9.2f}"
            f"{r.utilization:>7.1%}{r.mean_staleness:>6.2f}{r.wasted_switches:>8}"
            f"  {'*' if pt.best else ''}"
        )
    return "\n".join(lines)


def to_json(points: list[Point]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for pt in points:
        r = pt.result
        row: dict[str, Any] = {**pt.values, "policy": pt.policy, "best": pt.best}
        if r is None:
            row["error"] = pt.error
        else:
            row.update(total_h=r.total_h, ideal_h=r.ideal_h, utilization=r.utilization,
                       mean_staleness=r.mean_staleness, phi=r.phi, mu=r.mu,
                       wasted_switches=r.wasted_switches, wall_s=r.wall_s)  # fmt: skip
        rows.append(row)
    return {"points": rows, "best": {r["policy"]: r for r in rows if r["best"]}}


def plot(points: list[Point], path: str | Path) -> Path:
    """Hours per point, one line per policy, the best point of each starred (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = [pt for pt in points if pt.result is not None]
    labels = list(dict.fromkeys(_label(pt.values) for pt in points))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.0))
    for policy in dict.fromkeys(pt.policy for pt in run):
        mine = [pt for pt in run if pt.policy == policy]
        xs = [labels.index(_label(pt.values)) for pt in mine]
        hours = [pt.result.total_h for pt in mine if pt.result is not None]
        (line,) = ax.plot(xs, hours, marker="o", label=policy)
        best = next(pt for pt in mine if pt.best)
        assert best.result is not None
        ax.plot([labels.index(_label(best.values))], [best.result.total_h], marker="*",
                markersize=18, color=line.get_color(), linestyle="none")  # fmt: skip
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    steps = run[0].result.steps if run[0].result is not None else 0
    ax.set_ylabel(f"hours for {steps} steps")
    ax.set_title("what-if sweep (★ best per policy)")
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def policies_for(name: str) -> list[str]:
    return list(POLICIES) if name == "all" else [name]


def _divide(total: int, part: int, key: str) -> int:
    if part < 1 or total % part:
        raise ConfigError(f"--sweep {key}: {part} does not divide {total} nodes")
    return total // part


def _phi_mu(key: str, value: Any) -> tuple[float | None, int | None]:
    if key == "phi":
        return float(value), None
    if key == "mu":
        return None, int(value)
    phi, sep, mu = str(value).partition("/")
    if not sep:
        raise ConfigError(f"--sweep phi_mu: {value!r}; allowed φ/μ, e.g. 0.5/3")
    return float(phi), int(mu)


def _label(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in values.items())


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
