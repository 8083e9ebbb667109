"""What a resumed run takes over from its trace: every group not yet trained, and how to close
the executions the dead job left open (docs/runtime.md "Crashes and resume").

`read_trace(path, trained)` reads the run's trace once, before the coordinator reopens it
for writing, and returns a `Takeover`: per dispatched, untrained group its task instance,
dispatch version and members; per member either its closed verdict and tree, the partial
tree journaled while it ran (to be scored from its preserved workspace), or nothing at all
(it never launched). Pure reading; no process is started here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.runtime.shared.messages import VerdictRecord
from gyre.trajectory.reader import TraceReader
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import CloseStatus, VerdictStatus


class MemberState(enum.Enum):
    """What the trace says of a taken-over group's execution."""

    CLOSED = "closed"  # closed with its verdict (and, when scored, its tree)
    OPEN = "open"  # opened, never closed: its journaled tree is to be scored
    UNLAUNCHED = "unlaunched"  # dispatched, never opened


@dataclass(slots=True)
class Member:
    """One execution of a taken-over group."""

    id: str
    state: MemberState
    verdict: VerdictRecord | None = None  # closed: status + reward (no assessment rows)
    outcome: CloseStatus = CloseStatus.NOT_LAUNCHED  # closed: the execution's close status
    tree: TrajectoryTree | None = None  # closed & scored: its tree; open: the journal's


@dataclass(slots=True)
class CarriedGroup:
    """A dispatched group the checkpointed weights have not trained."""

    id: str
    task: str
    instance: int
    version: int
    members: list[Member] = field(default_factory=list)


@dataclass(slots=True)
class Takeover:
    """The trace's view of a resumed run."""

    groups: list[CarriedGroup]
    next_group: int  # the first unused group number (g<n>)
    executions: int  # executions recorded in the trace so far


def read_trace(path: Path, trained: set[str]) -> Takeover:
    """The untrained groups of the trace at `path` and the state of their executions."""
    with TraceReader(path) as r:
        infos = {i.execution_id: i for i in r.executions()}
        journal = r.recover()
        dispatched: dict[str, CarriedGroup] = {}
        for row in r.rows("groups"):
            gid = row["group_id"]
            g = dispatched.get(gid)
            if g is None:
                task, _, inst = row["task_id"].partition("@")
                g = dispatched[gid] = CarriedGroup(
                    id=gid, task=task, instance=int(inst or 0), version=int(row["policy_version"])
                )
            g.members.append(Member(id=row["execution_id"], state=MemberState.UNLAUNCHED))
        numbers = [
            int(gid.rsplit("g", 1)[1]) for gid in dispatched if gid.rsplit("g", 1)[1].isdigit()
        ]
        carried = [g for gid, g in dispatched.items() if gid not in trained]
        for g in carried:
            for m in g.members:
                _fill(m, infos.get(m.id), journal, r)
    return Takeover(groups=carried, next_group=max(numbers, default=-1) + 1,
                    executions=len(infos))  # fmt: skip


def _fill(m: Member, info: Any, journal: dict[str, TrajectoryTree], r: TraceReader) -> None:
    if info is None:
        return  # dispatched, never opened: it never launched
    if not info.closed:
        m.state, m.tree = MemberState.OPEN, journal.get(m.id) or TrajectoryTree(m.id)
        return
    meta = info.meta
    reward = meta.get("reward")
    if isinstance(reward, float) and math.isnan(reward):
        reward = None
    m.state, m.outcome = MemberState.CLOSED, CloseStatus(info.status)
    status = VerdictStatus(meta.get("verdict", VerdictStatus.EXCLUDED.value))
    m.verdict = VerdictRecord(status=status, reward=reward, t=info.t_close or info.t_open)
    if status is VerdictStatus.SCORED:
        m.tree = r.tree(m.id)
