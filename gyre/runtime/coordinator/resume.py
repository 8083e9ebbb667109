"""The coordinator's resume of a run: the dead job's untrained groups re-enter the ledger, its
open executions are closed, and the groups worth training are carried into the scheduler
(docs/runtime.md "Crashes and resume").

A `Resume` is the run directory's `Handover` (`gyre.runtime.shared.takeover`: the newest
checkpoint and what the trace holds beyond it) acted on: `reopen`, before the scheduler
starts, enters each untrained group in the ledger with its members; an execution that was
running is scored again from its preserved workspace (a `Rescore` to the proxy node, which
holds it) and closed with its journaled tree when its `Assessed` comes back; one that made no
model call is closed unrecoverable, one that never launched as not launched. Once every
rescore is in, `carry` keeps the groups with a usable execution, renumbered 0..c-1.
`close_not_launched` also closes what a run's end left unlaunched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gyre.runtime.coordinator.ledger import Execution, ExecutionState, GroupRecord, Ledger
from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.takeover import CarriedGroup, Handover, MemberState
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import CloseStatus


class Resume(Handover):
    """Where a run starts: the newest checkpoint's driver state and the trace's take-over
    (neither for a fresh run), then the groups carried and the executions being rescored."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.carried = 0  # scheduler groups 0..carried-1 were taken over from the trace
        self.recovering: dict[int, TrajectoryTree] = {}  # execution -> its journaled tree

    def group_number(self, group: int) -> int:
        """The run-wide number of scheduler group `group` (its id g<number>, unique across
        resumes)."""
        first_new = self.takeover.next_group if self.takeover else 0
        return first_new + group - self.carried

    def reopen(
        self, ledger: Ledger, rec: RunRecorder, to_proxy: Callable[[msg.Message], None]
    ) -> None:
        """Enter the taken-over groups in `ledger`; an execution sent to be scored again waits
        in `recovering` (its `Assessed` closes it with the journaled tree)."""
        assert self.takeover is not None
        self.check_groups(ledger.n)
        for cg in self.takeover.groups:
            g = len(ledger.groups)
            first = len(ledger.executions)
            ledger.add(GroupRecord(cg.id, cg.task, cg.instance, cg.version), [
                Execution(id=m.id, group=g, state=ExecutionState.RECORDED, outcome=m.outcome,
                          verdict=m.verdict, tree=m.tree) for m in cg.members
            ])  # fmt: skip
            for i, m in enumerate(cg.members, start=first):
                x = ledger.executions[i]
                if m.state is MemberState.OPEN and m.tree is not None and len(m.tree):
                    x.state, x.outcome = ExecutionState.TERMINATED, CloseStatus.RECOVERED
                    self.recovering[i] = m.tree
                    to_proxy(msg.Rescore(i, m.id, cg.task, cg.instance, m.tree))
                elif m.state is MemberState.OPEN:  # no model call yet: its reward would say nothing
                    close_unrecoverable(ledger, rec, i, "the job died before it made a model call")
                elif m.state is MemberState.UNLAUNCHED:
                    close_not_launched(ledger, rec, i, "the job died first")

    def carry(self, ledger: Ledger) -> tuple[list[CarriedGroup], list[str]]:
        """The groups with a usable execution (kept, renumbered 0..c-1) and the ids of the rest."""
        assert self.takeover is not None
        carried: list[CarriedGroup] = []
        dropped = []
        for g, cg in enumerate(self.takeover.groups):
            if ledger.usable(g):
                carried.append(cg)
            else:
                dropped.append(cg.id)
        ledger.keep_only({c.id for c in carried})
        self.carried = len(carried)
        return carried, dropped


def close_unrecoverable(ledger: Ledger, rec: RunRecorder, i: int, why: str) -> None:
    """An execution a dead job left open that cannot be scored: excluded, with the reason."""
    x = ledger.executions[i]
    verdict = msg.VerdictRecord.excluded(f"unrecoverable: {why}", time.time())
    rec.close_execution(x.id, ledger.groups[x.group].id, rec.journaled_tree(x.id),
                        CloseStatus.UNRECOVERABLE, verdict)  # fmt: skip
    x.state, x.outcome, x.verdict = ExecutionState.RECORDED, CloseStatus.UNRECOVERABLE, verdict


def close_not_launched(ledger: Ledger, rec: RunRecorder, i: int,
                       why: str = "the run ended first") -> None:  # fmt: skip
    """A dispatched execution that never launched (the run ended, or the job died, first)."""
    x, g = ledger.executions[i], ledger.group_of(i)
    rec.open_execution(x.id, {"group": g.id, "task": g.task, "instance": g.instance})
    verdict = msg.VerdictRecord.excluded(f"dispatched, never launched: {why}", time.time())
    rec.close_execution(x.id, g.id, TrajectoryTree(x.id), CloseStatus.NOT_LAUNCHED, verdict)
    x.state, x.outcome, x.verdict = ExecutionState.RECORDED, CloseStatus.NOT_LAUNCHED, verdict
