"""What the coordinator writes into the run's trace (`runs/<id>/trace.h5`).

The coordinator is the single writer of the HDF5 store (docs/trace-format.md). This module
maps runtime facts onto the store's declared tables:

* `roles` — the role timeline, one row per (cell, role) interval, transitions included;
* `events` — switches with measured durations, reroutes, engine losses, publications,
  evaluator failures (`detail` is JSON);
* `dispatch` — counters after each dispatch and each step;
* `steps` — per optimizer step: loss, reward mean, staleness, micro-steps, duration, ...;
* `groups`, `rewards`, `assessments` — who ran what, designated rewards and validity;
* one closed trajectory tree per dispatched execution (not-launched ones: an empty tree
  with status "not_launched"), its nodes journaled as the proxy recorded them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from gyre.runtime.shared.messages import VerdictRecord
from gyre.tasks.evaluator import Assessment, Validity
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import CloseStatus, Role


class RunRecorder:
    """Thin, typed helpers over one `TraceWriter`."""

    def __init__(self, path: Path, run_meta: dict[str, Any], cells: int) -> None:
        """A new trace, or — when `path` exists (a resumed run) — the same one, continued."""
        self.writer = (
            TraceWriter.reopen(path) if path.exists() else TraceWriter(path, run_meta=run_meta)
        )
        now = time.time()
        self.role_since = [(Role.ROLLOUT, now)] * cells

    # ------------------------------------------------------------------ timeline

    def set_roles(self, roles: list[Role], now: float | None = None) -> None:
        """Close the interval of every cell whose role changed; open the new one."""
        t = time.time() if now is None else now
        rows = []
        for c, role in enumerate(roles):
            old, since = self.role_since[c]
            if role is not old:
                rows.append({"cell": c, "role": old.value, "t_start": since, "t_end": t})
                self.role_since[c] = (role, t)
        if rows:
            self.writer.append("roles", rows)

    def close_roles(self) -> None:
        t = time.time()
        rows = [
            {"cell": c, "role": role.value, "t_start": since, "t_end": t}
            for c, (role, since) in enumerate(self.role_since)
        ]
        self.writer.append("roles", rows)

    # ------------------------------------------------------------------ tables

    def event(self, kind: str, **detail: Any) -> None:
        self.writer.append(
            "events", [{"t": time.time(), "kind": kind, "detail": json.dumps(detail)}]
        )

    def dispatch(self, version: int, groups: int, executions: int, sched: Any) -> None:
        queued = sched.d - sched.p
        row = {
            "t": time.time(), "policy_version": version, "groups": groups,
            "executions": executions, "queued": queued, "running": sched.p - sched.f,
            "closed": sched.f,
        }  # fmt: skip
        self.writer.append("dispatch", [row])

    def groups(self, group_id: str, task: str, executions: list[str], version: int) -> None:
        t = time.time()
        rows = [
            {"group_id": group_id, "task_id": task, "execution_id": x,
             "policy_version": version, "t_dispatch": t}
            for x in executions
        ]  # fmt: skip
        self.writer.append("groups", rows)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        t = time.time()
        rows = [{"step": step, "t": t, "name": k, "value": float(v)} for k, v in metrics.items()]
        self.writer.append("steps", rows)

    # ------------------------------------------------------------------ executions

    def open_execution(self, eid: str, meta: dict[str, Any]) -> None:
        self.writer.open_execution(eid, meta)

    def journal(self, eid: str, node: Any) -> None:
        """One model call of a running execution, on disk at once (a crash loses nothing)."""
        self.writer.record_node(eid, node)

    def journaled_tree(self, eid: str) -> TrajectoryTree:
        return self.writer.journaled_tree(eid)

    def close_execution(
        self,
        eid: str,
        group_id: str,
        tree: TrajectoryTree,
        status: CloseStatus,
        verdict: VerdictRecord,
        *,
        t_ended: float | None = None,
    ) -> None:
        """The tree, its close status, its reward and validity, and every assessment of one
        execution; `t_ended`: when its harness ended (between its last model call and its
        close)."""
        valid = verdict.usable
        reward = verdict.reward
        meta: dict[str, Any] = {"reward": reward, "valid": valid, "verdict": verdict.status.value}
        if verdict.error:
            meta["error"] = verdict.error
        if verdict.tests:  # a repository task's per-test outcomes; absent: none
            meta["tests"] = [t.to_dict() for t in verdict.tests]
        if t_ended is not None:
            meta["t_ended"] = t_ended
        closed_as = CloseStatus(status).value  # (a caller's plain "completed" reads too)
        self.writer.close_execution(eid, tree, status=closed_as, meta=meta)
        r = float("nan") if reward is None else float(reward)
        self.writer.append(
            "rewards",
            [{"execution_id": eid, "group_id": group_id, "reward": r, "valid": valid,
              "t": verdict.t}],
        )  # fmt: skip
        rows = [_assessment_row(a) for a in verdict.assessments]
        if rows:
            self.writer.append("assessments", rows)

    def close(self) -> None:
        self.writer.close()


def _assessment_row(a: Assessment) -> dict[str, Any]:
    """The trace's `assessments` row of one scoring attempt."""
    score = a.score
    return {
        "execution_id": a.execution_id,
        "attempt": a.attempt,
        "score": float(score) if score is not None and math.isfinite(score) else float("nan"),
        "valid": a.validity is Validity.VALID,
        "state_ref": a.state_ref or "",
        "evaluator": a.kind,
        "detail": json.dumps({"validity": a.validity.value, "error": a.error, "seq": a.seq}),
        "t": float(a.t_end),
        "critique": a.critique,
    }
