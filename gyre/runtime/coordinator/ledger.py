"""The coordinator's ledger: every dispatched group and execution, their membership and outcomes.

A group of N + k executions (k: `schedule.oversample`, 0 by default) is dispatched as one;
scheduler group g owns executions g(N+k) .. g(N+k)+N+k-1, and `members(g)` is the one place
that knowledge lives; which N of them train is the scheduler's (`AdmitGroup.members`), or
`trained` for a group a resumed run carried in. An execution moves
queued -> running -> terminated (its harness ended) -> recorded (its tree and verdict are in
the trace). The coordinator appends to the ledger as the scheduler dispatches, and reads it
to admit a group, to cancel what still runs at the end, and to say why nothing trained.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gyre.runtime.shared import messages as msg
from gyre.schedule.groups import trained_members
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.vocabulary import CloseStatus


class ExecutionState(enum.Enum):
    """Where an execution is in its lifecycle, as the coordinator sees it."""

    QUEUED = "queued"  # dispatched, not launched
    RUNNING = "running"  # its harness runs
    TERMINATED = "terminated"  # its harness ended; its verdict is not recorded yet
    RECORDED = "recorded"  # its tree and verdict are in the trace


@dataclass(slots=True)
class Execution:
    """Everything the coordinator knows about one dispatched execution."""

    id: str
    group: int
    state: ExecutionState = ExecutionState.QUEUED
    # its close status in the trace: how its harness ended, or why it has no harness outcome
    outcome: CloseStatus = CloseStatus.NOT_LAUNCHED
    reason: str = ""  # why the harness did not complete
    t_ended: float | None = None  # when its harness ended (the coordinator's clock)
    verdict: msg.VerdictRecord | None = None
    tree: Any = None  # kept from scoring until its group is admitted

    @property
    def live(self) -> bool:
        return self.state in (ExecutionState.RUNNING, ExecutionState.TERMINATED)


@dataclass(slots=True)
class GroupRecord:
    """One dispatched group: its task instance, dispatch version and scoring progress."""

    id: str
    task: str
    instance: int
    version: int
    assessed: int = 0
    trained: tuple[int, ...] | None = None  # its members, once admitted (then trees are dropped)


class Ledger:
    """The groups and executions of a run, in scheduler order (index = scheduler id)."""

    def __init__(self, group_size: int) -> None:
        self.n = group_size  # executions per group: N + k
        self.groups: list[GroupRecord] = []
        self.executions: list[Execution] = []

    def add(self, group: GroupRecord, executions: list[Execution]) -> int:
        """Append a group and its N + k executions; returns its scheduler index."""
        self.groups.append(group)
        self.executions += executions
        return len(self.groups) - 1

    def members(self, group: int) -> list[Execution]:
        """The N + k executions of scheduler group `group`."""
        return self.executions[group * self.n : (group + 1) * self.n]

    def indices(self, group: int) -> range:
        """The scheduler's ids of group `group`'s N + k executions."""
        return range(group * self.n, (group + 1) * self.n)

    def group_of(self, execution: int) -> GroupRecord:
        return self.groups[self.executions[execution].group]

    def live(self) -> list[Execution]:
        """Executions whose harness runs or whose verdict is not recorded yet."""
        return [x for x in self.executions if x.live]

    def queued(self) -> list[int]:
        """Executions dispatched and never launched."""
        return [i for i, x in enumerate(self.executions) if x.state is ExecutionState.QUEUED]

    def outcomes(
        self, group: int, trained: Sequence[int]
    ) -> tuple[list[ExecutionOutcome], dict[str, Any]]:
        """The training outcomes and trees of a complete group's `trained` executions (the
        scheduler's indices); every tree of the group leaves the ledger."""
        members = [self.executions[i] for i in trained]
        outcomes = []
        for x in members:
            assert x.verdict is not None
            outcomes.append(ExecutionOutcome(execution_id=x.id, reward=x.verdict.reward,
                                             status=Status.of(x.verdict.status)))  # fmt: skip
        trees = {x.id: x.tree for x in members if x.tree is not None}
        for x in self.members(group):
            x.tree = None  # the packing buffer holds the members' now; the surplus' are dropped
        self.groups[group].trained = tuple(trained)
        return outcomes, trees

    def trained(self, group: int, n: int) -> tuple[int, ...]:
        """The N that train of a group whose every execution is recorded (a resumed run's):
        the oversampling rule over the order their verdicts were given."""
        order = sorted(self.indices(group), key=lambda i: (self._t(i), i))
        return trained_members([(i, self._usable(i)) for i in order], n)

    def _t(self, i: int) -> float:
        verdict = self.executions[i].verdict
        return verdict.t if verdict is not None else float("inf")

    def _usable(self, i: int) -> bool:
        verdict = self.executions[i].verdict
        return verdict is not None and verdict.usable

    def usable(self, group: int) -> bool:
        """Whether any execution of the group has a verdict training can use."""
        return any(x.verdict is not None and x.verdict.usable for x in self.members(group))

    def keep_only(self, keep: set[str]) -> None:
        """Renumber: the kept groups become groups 0..k-1, in order (the others leave)."""
        groups: list[GroupRecord] = []
        executions: list[Execution] = []
        for g, group in enumerate(self.groups):
            if group.id in keep:
                for x in self.members(g):
                    x.group = len(groups)
                    executions.append(x)
                groups.append(group)
        self.groups, self.executions = groups, executions

    def why_untrainable(self) -> str:
        """The executions so far by outcome, and why the first failed harness failed."""
        counts: dict[str, int] = {}
        for x in self.executions:
            if x.verdict is not None:
                key = f"{x.outcome.value}/{x.verdict.status.value}"
                counts[key] = counts.get(key, 0) + 1
        text = "executions so far (harness outcome/verdict): " + ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items())
        )
        failed = next((x for x in self.executions if x.outcome is CloseStatus.FAILED), None)
        if failed is not None:  # the runner's reason carries the harness's stderr tail
            text += f"; {failed.id}'s harness failed: {failed.reason or '(no reason given)'}"
        return text
