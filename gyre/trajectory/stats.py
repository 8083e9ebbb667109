"""Run statistics from a trace: `gyre trace stats RUN_DIR [--json]` and the report's plots.

Computed from the same flat tables `gyre trace export` writes (`build_tables`), so the
numbers here are the numbers an analyst gets from the Parquet files:

* `staleness` — the histogram of scheduling staleness d = v_t - v_d over admitted groups
  (from the coordinator's `admit` events), the per-step mean / max from the `steps` table,
  and, for sampled tokens, the lag between the training version and the version that
  sampled them (when `admit` events name it);
* `tokens` — stored tokens by provenance, and by role and provenance;
* `trees` — calls, leaves, depth and branching, stored versus flat tokens (the sharing the
  execution-level objective exploits);
* `outcomes` — executions by close status with their scores: zero, partial (0 < r < 1)
  and full rewards, timeouts whose preserved work was scored, evaluator attempts;
* `scheduling` — role switches and their durations, reroutes (coordinator moves and engine
  retries), publications, engine losses, seconds per role.

    stats = run_stats("runs/x")          # a plain JSON-safe dict
    print_stats(stats); plot_stats(stats, Path("runs/x/report"))
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gyre.trajectory.export import INPUT_PROVENANCES, PROVENANCE_NAMES, build_tables
from gyre.trajectory.reader import TraceReader, trace_path
from gyre.vocabulary import Outcome

ADMIT_EVENT = "admit"  # detail: {"group": id, "batch": b, "staleness": d}


def run_stats(source: str | Path) -> dict[str, Any]:
    """Every statistic of the run whose trace is `source` (a run directory or a trace file)."""
    path = trace_path(source)
    with TraceReader(path) as reader:
        t = build_tables(reader)
    events = _events(t["events"])
    ex = t["executions"]
    return {
        "trace": str(path),
        "executions": ex.num_rows,
        "open_executions": ex.num_rows - int(_col(ex, "closed").sum()),
        "steps": len(set(_col(t["steps"], "step").tolist())),
        "staleness": staleness(t, events),
        "tokens": tokens(t["nodes"]),
        "trees": trees(ex, t["nodes"]),
        "outcomes": outcomes(ex, t["assessments"]),
        "scheduling": scheduling(t, events),
    }


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def _events(table: pa.Table) -> dict[str, list[dict[str, Any]]]:
    """Event details (JSON objects) by kind; a detail that is not JSON becomes {"text": ...}."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for kind, detail in zip(_col(table, "kind"), _col(table, "detail")):
        try:
            value = json.loads(detail)
        except ValueError:
            value = {"text": detail}
        out[str(kind)].append(value if isinstance(value, dict) else {"value": value})
    return out


def _histogram(values: Any, weights: Any = None) -> dict[str, float]:
    """{value: count (or weight sum)} with keys in numeric order, as JSON-safe strings."""
    counts: Counter[int] = Counter()
    for i, v in enumerate(values):
        counts[int(v)] += 1 if weights is None else weights[i]
    return {str(k): counts[k] for k in sorted(counts)}


def _summary(values: np.ndarray) -> dict[str, float | None]:
    if not len(values):
        return {"mean": None, "max": None}
    return {"mean": float(np.mean(values)), "max": float(np.max(values))}


def staleness(t: dict[str, pa.Table], events: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Group staleness (admit events), per-step staleness, and sampled-token lag."""
    admits = [e for e in events.get(ADMIT_EVENT, []) if "staleness" in e and "group" in e]
    d = np.array([int(e["staleness"]) for e in admits], np.int64)
    steps = t["steps"]
    names, step, value = _col(steps, "name"), _col(steps, "step"), _col(steps, "value")
    per_step: dict[int, dict[str, float]] = defaultdict(dict)
    for s, n, v in zip(step, names, value):
        if n in ("staleness_mean", "staleness_max"):
            per_step[int(s)][str(n)[len("staleness_") :]] = float(v)
    return {
        "groups": {"admitted": len(admits), "histogram": _histogram(d), **_summary(d)},
        "steps": [{"step": s, **per_step[s]} for s in sorted(per_step)],
        "token_lag": _token_lag(t, admits),
    }


def _token_lag(t: dict[str, pa.Table], admits: list[dict[str, Any]]) -> dict[str, float]:
    """Sampled tokens by (training version - sampling version), for admitted groups.

    The training version of a group is its dispatch version plus its staleness d.
    """
    groups = t["groups"]
    v_d = dict(zip(_col(groups, "group_id"), _col(groups, "policy_version").tolist()))
    v_t = {e["group"]: v_d[e["group"]] + int(e["staleness"]) for e in admits if e["group"] in v_d}
    ex = t["executions"]
    group_of = dict(zip(_col(ex, "execution_id"), _col(ex, "group_id")))
    nodes = t["nodes"]
    lags, weights = [], []
    for eid, version, n_out in zip(
        _col(nodes, "execution_id"), _col(nodes, "policy_version"), _col(nodes, "output_tokens")
    ):
        trained = v_t.get(group_of.get(eid, ""))
        if trained is not None and n_out:
            lags.append(trained - int(version))
            weights.append(int(n_out))
    return _histogram(lags, weights)


def tokens(nodes: pa.Table) -> dict[str, Any]:
    """Stored tokens by provenance, and by role then provenance (outputs are `policy`)."""
    by_role: dict[str, Counter[str]] = defaultdict(Counter)
    roles = _col(nodes, "role")
    columns = {"policy": _col(nodes, "output_tokens")}
    columns.update({PROVENANCE_NAMES[p]: _col(nodes, f"input_{PROVENANCE_NAMES[p]}")
                    for p in INPUT_PROVENANCES})  # fmt: skip
    for name, counts in columns.items():
        for role, n in zip(roles, counts.tolist()):
            by_role[str(role)][name] += n
    total = Counter({name: int(c.sum()) for name, c in columns.items()})
    return {
        "total": sum(total.values()),
        "by_provenance": {n: total[n] for n in PROVENANCE_NAMES},
        "by_role": {r: {n: c[n] for n in PROVENANCE_NAMES} for r, c in sorted(by_role.items())},
    }


def trees(ex: pa.Table, nodes: pa.Table) -> dict[str, Any]:
    """Tree shape over executions with calls: depth, leaves, branching, stored vs flat."""
    has_calls = _col(ex, "num_nodes") > 0
    depth, leaves = _col(ex, "depth")[has_calls], _col(ex, "num_leaves")[has_calls]
    children = _col(nodes, "children")
    inner = children[children > 0]
    root_children = Counter(
        eid
        for eid, parent in zip(_col(nodes, "execution_id"), _col(nodes, "parent_id"))
        if not parent
    )
    stored, flat = int(_col(ex, "unique_tokens").sum()), int(_col(ex, "flat_tokens").sum())
    return {
        "executions_with_calls": int(has_calls.sum()),
        "nodes": nodes.num_rows,
        "leaves": int(leaves.sum()),
        "depth": _summary(depth),
        "depth_histogram": _histogram(depth),
        "leaves_histogram": _histogram(leaves),
        "branch_points": int((children > 1).sum()) + sum(n > 1 for n in root_children.values()),
        "max_children": int(max(children.max(initial=0), max(root_children.values(), default=0))),
        "mean_children": float(inner.mean()) if len(inner) else None,
        "stored_tokens": stored,
        "flat_tokens": flat,
        "flat_over_stored": flat / stored if stored else None,
        "stored_policy_tokens": int(_col(ex, "unique_policy_tokens").sum()),
        "flat_policy_tokens": int(_col(ex, "flat_policy_tokens").sum()),
    }


def outcomes(ex: pa.Table, assessments: pa.Table) -> dict[str, Any]:
    """Executions by close status with their rewards; evaluator attempts and validity."""
    status, reward = _col(ex, "status"), _col(ex, "reward").astype(np.float64)
    valid = np.array([v is True for v in ex.column("valid").to_pylist()])
    by_status = {}
    for s in sorted(set(status.tolist())):
        sel = status == s
        scored = sel & valid & ~np.isnan(reward)
        r = reward[scored]
        by_status[str(s)] = {
            "executions": int(sel.sum()),
            "scored": int(scored.sum()),
            "reward_mean": float(r.mean()) if len(r) else None,
            "zero": int((r <= 0).sum()),
            "partial": int(((r > 0) & (r < 1)).sum()),
            "full": int((r >= 1).sum()),
        }
    a_valid = _col(assessments, "valid").astype(bool)
    attempts = Counter(_col(assessments, "execution_id").tolist())
    timed_out = by_status.get(Outcome.TIMED_OUT.value, {})
    return {
        "by_status": by_status,
        "verdicts": dict(sorted(Counter(_col(ex, "verdict").tolist()).items())),
        "timeouts": timed_out.get("executions", 0),
        "timeouts_scored": timed_out.get("scored", 0),
        "timeouts_partial": timed_out.get("partial", 0),
        "assessments": {
            "attempts": assessments.num_rows,
            "invalid": int((~a_valid).sum()),
            "retried_executions": sum(n > 1 for n in attempts.values()),
        },
    }


def scheduling(t: dict[str, pa.Table], events: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Role switches with durations, reroutes, publications, engine losses, seconds per role."""
    switches = events.get("switch", [])
    seconds = np.array([float(e.get("seconds", math.nan)) for e in switches], np.float64)
    roles = t["roles"]
    role_s: dict[str, float] = defaultdict(float)
    for role, a, b in zip(_col(roles, "role"), _col(roles, "t_start"), _col(roles, "t_end")):
        role_s[str(role)] += float(b - a)
    held = sum(role_s.values())
    attempts = _col(t["nodes"], "attempts")
    return {
        "switches": len(switches),
        "switches_by_target": dict(sorted(Counter(str(e.get("to")) for e in switches).items())),
        "switch_seconds": _summary(seconds[~np.isnan(seconds)]),
        "reroutes": len(events.get("reroute", [])),
        "retried_calls": int((attempts > 1).sum()),
        "extra_attempts": int((attempts - 1).sum()),
        "publications": len(events.get("publish", [])),
        "engine_losses": len(events.get("engine_lost", [])),
        "role_seconds": dict(sorted(role_s.items())),
        "train_share": role_s.get("train", 0.0) / held if held else None,
    }


# -- human output -----------------------------------------------------------------------------


def print_stats(stats: dict[str, Any]) -> None:
    """The statistics as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    o, tr, sc, st = stats["outcomes"], stats["trees"], stats["scheduling"], stats["staleness"]
    console.print(f"{stats['trace']}: {stats['executions']} executions "
                  f"({stats['open_executions']} open), {stats['steps']} steps")  # fmt: skip
    console.print(_kv_table("staleness", {
        "admitted groups": st["groups"]["admitted"],
        "group staleness d: count": _fmt_hist(st["groups"]["histogram"]),
        "mean / max d": f"{_num(st['groups']['mean'])} / {_num(st['groups']['max'])}",
        "per step mean / max": ", ".join(
            f"{s['step']}: {_num(s.get('mean'))}/{_num(s.get('max'))}" for s in st["steps"]),
        "sampled tokens by lag": _fmt_hist(st["token_lag"]),
    }))  # fmt: skip
    rows = {**stats["tokens"]["by_role"], "all": stats["tokens"]["by_provenance"]}
    table = Table("provenance", *rows, title="stored tokens by role", title_justify="left")
    for name in [*PROVENANCE_NAMES, "total"]:
        cells = (c[name] if name != "total" else sum(c.values()) for c in rows.values())
        table.add_row(name, *map(str, cells))
    console.print(table)
    console.print(_kv_table("trajectory trees", {
        "calls / leaves": f"{tr['nodes']} / {tr['leaves']}",
        "depth mean / max": f"{_num(tr['depth']['mean'])} / {_num(tr['depth']['max'])}",
        "branch points / max children": f"{tr['branch_points']} / {tr['max_children']}",
        "stored / flat tokens": f"{tr['stored_tokens']} / {tr['flat_tokens']} "
                                f"(x{_num(tr['flat_over_stored'])})",
    }))  # fmt: skip
    table = Table("status", "executions", "scored", "reward mean", "zero", "partial", "full",
                  title="outcomes")  # fmt: skip
    for status, row in o["by_status"].items():
        table.add_row(status, *(_num(row[k]) for k in
                                ("executions", "scored", "reward_mean", "zero", "partial", "full")))  # fmt: skip
    console.print(table)
    console.print(_kv_table("scheduling", {
        "switches (by target)": f"{sc['switches']} {sc['switches_by_target']}",
        "switch seconds mean / max": f"{_num(sc['switch_seconds']['mean'])} / "
                                     f"{_num(sc['switch_seconds']['max'])}",
        "reroutes / retried calls": f"{sc['reroutes']} / {sc['retried_calls']}",
        "publications / engine losses": f"{sc['publications']} / {sc['engine_losses']}",
        "train share": _num(sc["train_share"]),
    }))  # fmt: skip


def _kv_table(title: str, rows: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(show_header=False, title=title, title_justify="left")
    for k, v in rows.items():
        table.add_row(k, str(v))
    return table


def _fmt_hist(hist: dict[str, float]) -> str:
    return "  ".join(f"{k}: {_num(v)}" for k, v in hist.items()) or "-"


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.3g}"
    return str(int(v))


# -- plots ------------------------------------------------------------------------------------


def plot_stats(stats: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG plots of `run_stats` output in `out_dir` (matplotlib, Agg); the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    st = stats["staleness"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    _bars(axes[0], st["groups"]["histogram"], "group staleness d", "groups")
    for key in ("mean", "max"):
        points = [(s["step"], s[key]) for s in st["steps"] if key in s]
        if points:
            axes[1].plot(*zip(*points), marker="o", label=f"per-step {key}")
            axes[1].legend()
    axes[1].set(xlabel="step", ylabel="staleness d")
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    _bars(axes[2], st["token_lag"], "training - sampling version", "sampled tokens")
    paths = [_save(fig, out_dir / "stats_staleness.png")]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    by_role = stats["tokens"]["by_role"]
    bottom = np.zeros(len(by_role))
    for name in PROVENANCE_NAMES:
        counts = np.array([by_role[r][name] for r in by_role], np.float64)
        ax.bar(list(by_role), counts, bottom=bottom, label=name)
        bottom += counts
    ax.set(ylabel="stored tokens", title="tokens by role and provenance")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    paths.append(_save(fig, out_dir / "stats_tokens.png"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    _bars(axes[0], stats["trees"]["depth_histogram"], "depth (calls)", "executions")
    _bars(axes[1], stats["trees"]["leaves_histogram"], "leaves (trajectories)", "executions")
    paths.append(_save(fig, out_dir / "stats_trees.png"))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    by_status = stats["outcomes"]["by_status"]
    bottom = np.zeros(len(by_status))
    for part in ("zero", "partial", "full"):
        counts = np.array([by_status[s][part] for s in by_status], np.float64)
        ax.bar(list(by_status), counts, bottom=bottom, label=f"{part} reward")
        bottom += counts
    unscored = [by_status[s]["executions"] - by_status[s]["scored"] for s in by_status]
    ax.bar(list(by_status), unscored, bottom=bottom, label="not scored", color="lightgrey")
    ax.set(ylabel="executions", title="outcomes by close status")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    paths.append(_save(fig, out_dir / "stats_outcomes.png"))
    return paths


def _bars(ax: Any, hist: dict[str, float], xlabel: str, ylabel: str) -> None:
    if hist:
        ax.bar(list(hist), list(hist.values()), color="#4c9be8")
    else:
        ax.text(0.5, 0.5, "not in this trace", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel=xlabel, ylabel=ylabel)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
