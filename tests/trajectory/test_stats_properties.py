"""`gyre trace stats` agrees with a slow, obvious recount on random small runs.

Hypothesis draws a run as plain data (groups of executions with random call trees, close
statuses, verdicts, assessments, admit / switch / reroute / publish / engine-loss events,
step rows, role intervals, some executions left open with only their journal), writes it
with the real `TraceWriter` the way the runtime does, and runs the real `run_stats`. Every
number stats reports is recounted here from the drawn data by loops over calls and rows
(no numpy, no export tables), so a miscount anywhere between the writer and the report
(store, reader, export, stats) shows up as a difference with a minimal example.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory.export import PROVENANCE_NAMES
from gyre.trajectory.stats import run_stats
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import Provenance, TrajectoryTree

INPUT_CODES = [int(p) for p in Provenance if p != Provenance.POLICY]
ROLES = ["main", "subagent", "compaction"]
STATUSES = ["completed", "timed_out", "failed", "cancelled"]
VERDICTS = [("scored", 0.0), ("scored", 0.4), ("scored", 1.0), ("excluded", None)]


@dataclass(frozen=True)
class Call:
    parent: int  # 0: the root
    inputs: tuple[int, ...]  # provenance code of each new input token
    outputs: int  # sampled tokens
    role: str
    version: int
    attempts: int


@dataclass
class Execution:
    id: str
    group: str
    calls: list[Call]
    status: str  # a close status, or "open" (never closed: only its journal is in the trace)
    verdict: str = ""
    reward: float | None = None
    assessments: list[bool] = field(default_factory=list)  # validity of each attempt


@dataclass
class Run:
    executions: list[Execution]
    dispatched: dict[str, int]  # group -> dispatch version
    admits: list[tuple[str, int]]  # (group, staleness)
    switches: list[tuple[str, float]]  # (target role, seconds)
    counts: dict[str, int]  # reroute / publish / engine_lost events
    steps: dict[int, tuple[float, float]]  # step -> (staleness mean, max)
    roles: list[tuple[int, str, float, float]]  # (cell, role, t_start, t_end)


SWITCH = st.tuples(st.sampled_from(["train", "rollout"]), st.floats(0.01, 5.0))
STEP = st.tuples(st.floats(0, 3), st.floats(0, 3))
ROLE_INTERVAL = st.builds(
    lambda cell, role, t, s: (cell, role, t, t + s),
    st.integers(0, 2),
    st.sampled_from(["rollout", "train"]),
    st.floats(0, 100),
    st.floats(0, 50),
)


@st.composite
def calls(draw: st.DrawFn) -> list[Call]:
    out: list[Call] = []
    for i in range(draw(st.integers(0, 5))):
        out.append(
            Call(
                parent=draw(st.integers(0, i)),
                inputs=tuple(draw(st.lists(st.sampled_from(INPUT_CODES), max_size=6))),
                outputs=draw(st.integers(0, 4)),
                role=draw(st.sampled_from(ROLES)),
                version=draw(st.integers(0, 3)),
                attempts=draw(st.integers(1, 3)),
            )
        )
    return out


@st.composite
def runs(draw: st.DrawFn) -> Run:
    executions, dispatched = [], {}
    for g in range(draw(st.integers(1, 3))):
        group = f"g{g}"
        dispatched[group] = draw(st.integers(0, 3))
        for e in range(draw(st.integers(1, 3))):
            x = Execution(f"{group}-e{e}", group, draw(calls()), "open")
            if draw(st.integers(0, 4)):  # most executions are closed and scored
                x.status = draw(st.sampled_from(STATUSES))
                x.verdict, x.reward = draw(st.sampled_from(VERDICTS))
                x.assessments = draw(st.lists(st.booleans(), max_size=3))
            executions.append(x)
    admitted = draw(st.lists(st.sampled_from(sorted(dispatched)), unique=True))
    return Run(
        executions=executions,
        dispatched=dispatched,
        admits=[(g, draw(st.integers(0, 3))) for g in admitted],
        switches=draw(st.lists(SWITCH, max_size=4)),
        counts={k: draw(st.integers(0, 3)) for k in ("reroute", "publish", "engine_lost")},
        steps=draw(st.dictionaries(st.integers(1, 5), STEP, max_size=3)),
        roles=draw(st.lists(ROLE_INTERVAL, max_size=4)),
    )


# ------------------------------------------------------------------ writing, as the runtime


def tree(x: Execution) -> TrajectoryTree:
    t = TrajectoryTree(x.id)
    for i, c in enumerate(x.calls):
        t.add_node(
            parent_id=c.parent,
            input_ids=np.arange(len(c.inputs)),
            input_provenance=np.array(c.inputs, np.uint8),
            output_ids=np.arange(c.outputs),
            output_logprobs=np.full(c.outputs, -1.0, np.float32),
            role=c.role,
            policy_version=c.version,
            engine_id="e0",
            t_start=1.0,
            t_end=2.0,
            finish_reason="stop",
            input_key=b"i%d" % i,
            output_key=b"o%d" % i,
            attempts=c.attempts,
        )
    return t


def write(run: Run, path: Path) -> None:
    with TraceWriter(path, run_meta={}) as w:
        for x in run.executions:
            w.append(
                "groups",
                [
                    {
                        "group_id": x.group,
                        "task_id": "t",
                        "execution_id": x.id,
                        "policy_version": run.dispatched[x.group],
                        "t_dispatch": 0.0,
                    }
                ],
            )
            w.open_execution(x.id, {"group": x.group})
            t = tree(x)
            for node in t.nodes:  # journaled as the proxy records them
                w.record_node(x.id, node)
            if x.status == "open":
                continue
            w.close_execution(x.id, t, status=x.status, meta={"verdict": x.verdict})
            r = math.nan if x.reward is None else x.reward
            w.append(
                "rewards",
                [
                    {
                        "execution_id": x.id,
                        "group_id": x.group,
                        "reward": r,
                        "valid": x.verdict != "excluded",
                        "t": 0.0,
                    }
                ],
            )
            w.append(
                "assessments",
                [
                    {
                        "execution_id": x.id,
                        "attempt": a + 1,
                        "score": 0.0,
                        "valid": ok,
                        "state_ref": "",
                        "evaluator": "final",
                        "detail": "",
                        "t": 0.0,
                        "critique": "",
                    }
                    for a, ok in enumerate(x.assessments)
                ],
            )
        events = [("admit", {"group": g, "batch": 0, "staleness": d}) for g, d in run.admits]
        events += [("switch", {"cell": 0, "to": to, "seconds": s}) for to, s in run.switches]
        events += [(k, {}) for k, n in run.counts.items() for _ in range(n)]
        w.append("events", [{"t": 0.0, "kind": k, "detail": json.dumps(d)} for k, d in events])
        w.append("events", [{"t": 0.0, "kind": "note", "detail": "not json"}])
        w.append(
            "steps",
            [
                {"step": s, "t": 0.0, "name": name, "value": v}
                for s, (mean, top) in run.steps.items()
                for name, v in (("staleness_mean", mean), ("staleness_max", top), ("loss", 9.0))
            ],
        )
        w.append(
            "roles", [{"cell": c, "role": r, "t_start": a, "t_end": b} for c, r, a, b in run.roles]
        )


# ------------------------------------------------------------------ the slow recount


def children(x: Execution) -> dict[int, list[int]]:
    """Node id (0: the root) -> its children's ids."""
    kids: dict[int, list[int]] = {i: [] for i in range(len(x.calls) + 1)}
    for i, c in enumerate(x.calls, start=1):
        kids[c.parent].append(i)
    return kids


def path(x: Execution, node: int) -> list[Call]:
    """The calls from the root down to `node`."""
    out = []
    while node:
        out.append(x.calls[node - 1])
        node = out[-1].parent
    return out[::-1]


def leaves(x: Execution) -> list[int]:
    kids = children(x)
    return [i for i in range(1, len(x.calls) + 1) if not kids[i]]


def histogram(values: list[int], weights: list[int] | None = None) -> dict[str, int]:
    counts: dict[int, int] = defaultdict(int)
    for i, v in enumerate(values):
        counts[v] += 1 if weights is None else weights[i]
    return {str(k): counts[k] for k in sorted(counts)}


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "max": None}
    return {"mean": sum(values) / len(values), "max": float(max(values))}


def expected_staleness(run: Run) -> dict[str, Any]:
    trained = {g: run.dispatched[g] + d for g, d in run.admits}
    lags, weights = [], []
    for x in run.executions:
        for c in x.calls:
            if x.group in trained and c.outputs:
                lags.append(trained[x.group] - c.version)
                weights.append(c.outputs)
    d = [d for _, d in run.admits]
    return {
        "groups": {"admitted": len(d), "histogram": histogram(d), **summary(d)},
        "steps": [
            {"step": s, "mean": run.steps[s][0], "max": run.steps[s][1]} for s in sorted(run.steps)
        ],
        "token_lag": histogram(lags, weights),
    }


def expected_tokens(run: Run) -> dict[str, Any]:
    by_role: dict[str, dict[str, int]] = {}
    for x in run.executions:
        for c in x.calls:
            row = by_role.setdefault(c.role, dict.fromkeys(PROVENANCE_NAMES, 0))
            row["policy"] += c.outputs
            for code in c.inputs:
                row[PROVENANCE_NAMES[code]] += 1
    total = {n: sum(r[n] for r in by_role.values()) for n in PROVENANCE_NAMES}
    return {
        "total": sum(total.values()),
        "by_provenance": total,
        "by_role": dict(sorted(by_role.items())),
    }


def expected_trees(run: Run) -> dict[str, Any]:
    with_calls = [x for x in run.executions if x.calls]
    depth = [max(len(path(x, i)) for i in range(1, len(x.calls) + 1)) for x in with_calls]
    n_leaves = [len(leaves(x)) for x in with_calls]
    fan = [len(k) for x in run.executions for k in children(x).values()]  # root included
    inner = [len(k) for x in run.executions for i, k in children(x).items() if i and k]
    size = [len(c.inputs) + c.outputs for x in run.executions for c in x.calls]
    flat = [
        sum(len(c.inputs) + c.outputs for c in path(x, leaf))
        for x in run.executions
        for leaf in leaves(x)
    ]
    flat_policy = [
        sum(c.outputs for c in path(x, leaf)) for x in run.executions for leaf in leaves(x)
    ]
    stored = sum(size)
    return {
        "executions_with_calls": len(with_calls),
        "nodes": len(size),
        "leaves": sum(n_leaves),
        "depth": summary(depth),
        "depth_histogram": histogram(depth),
        "leaves_histogram": histogram(n_leaves),
        "branch_points": sum(1 for n in fan if n > 1),
        "max_children": max(fan, default=0),
        "mean_children": sum(inner) / len(inner) if inner else None,
        "stored_tokens": stored,
        "flat_tokens": sum(flat),
        "flat_over_stored": sum(flat) / stored if stored else None,
        "stored_policy_tokens": sum(c.outputs for x in run.executions for c in x.calls),
        "flat_policy_tokens": sum(flat_policy),
    }


def expected_outcomes(run: Run) -> dict[str, Any]:
    by_status = {}
    for status in sorted({x.status for x in run.executions}):
        xs = [x for x in run.executions if x.status == status]
        r = [x.reward for x in xs if x.verdict == "scored" and x.reward is not None]
        by_status[status] = {
            "executions": len(xs),
            "scored": len(r),
            "reward_mean": sum(r) / len(r) if r else None,
            "zero": sum(1 for v in r if v <= 0),
            "partial": sum(1 for v in r if 0 < v < 1),
            "full": sum(1 for v in r if v >= 1),
        }
    timed_out = by_status.get("timed_out", {})
    attempts = [ok for x in run.executions for ok in x.assessments]
    return {
        "by_status": by_status,
        "verdicts": dict(sorted(Counter(x.verdict for x in run.executions).items())),
        "timeouts": timed_out.get("executions", 0),
        "timeouts_scored": timed_out.get("scored", 0),
        "timeouts_partial": timed_out.get("partial", 0),
        "assessments": {
            "attempts": len(attempts),
            "invalid": sum(1 for ok in attempts if not ok),
            "retried_executions": sum(1 for x in run.executions if len(x.assessments) > 1),
        },
    }


def expected_scheduling(run: Run) -> dict[str, Any]:
    role_s: dict[str, float] = defaultdict(float)
    for _, role, a, b in run.roles:
        role_s[role] += b - a
    held = sum(role_s.values())
    attempts = [c.attempts for x in run.executions for c in x.calls]
    return {
        "switches": len(run.switches),
        "switches_by_target": dict(sorted(Counter(to for to, _ in run.switches).items())),
        "switch_seconds": summary([s for _, s in run.switches]),
        "reroutes": run.counts["reroute"],
        "retried_calls": sum(1 for a in attempts if a > 1),
        "extra_attempts": sum(a - 1 for a in attempts),
        "publications": run.counts["publish"],
        "engine_losses": run.counts["engine_lost"],
        "role_seconds": dict(sorted(role_s.items())),
        "train_share": role_s.get("train", 0.0) / held if held else None,
    }


def differences(actual: Any, expected: Any, where: str) -> list[str]:
    """Where `actual` differs from `expected` (floats equal up to rounding: sums and means
    are taken in another order), as "key.path: actual != expected" lines."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if actual.keys() != expected.keys():
            return [f"{where} keys: {sorted(actual)} != {sorted(expected)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{where}.{k}")]
    if isinstance(expected, list) and isinstance(actual, list) and len(actual) == len(expected):
        return [d for i, (a, e) in enumerate(zip(actual, expected))
                for d in differences(a, e, f"{where}[{i}]")]  # fmt: skip
    if isinstance(expected, float) and isinstance(actual, int | float):
        same = actual == pytest.approx(expected, rel=1e-9)
    else:
        same = type(actual) is type(expected) and actual == expected
    return [] if same else [f"{where}: {actual!r} != {expected!r}"]


# ------------------------------------------------------------------ the property


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_stats_equal_a_recount_of_what_was_written(run: Run) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write(run, Path(tmp) / "trace.h5")
        stats = run_stats(tmp)
    expected = {
        "executions": len(run.executions),
        "open_executions": sum(1 for x in run.executions if x.status == "open"),
        "steps": len(run.steps),
        "staleness": expected_staleness(run),
        "tokens": expected_tokens(run),
        "trees": expected_trees(run),
        "outcomes": expected_outcomes(run),
        "scheduling": expected_scheduling(run),
    }
    stats.pop("trace")
    wrong = differences(stats, expected, "stats")
    assert not wrong, "\n".join(wrong)
