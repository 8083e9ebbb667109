"""Rollout groups inside the scheduler: their executions, outcomes and trained members.

A group is dispatched as N + k executions (`ScheduleConfig.executions_per_group`; k:
`oversample`, 0 by default), group g owning executions g(N+k) .. g(N+k)+N+k-1. An
execution can end without a valid reward (evaluator crash, overall budget, unrecoverable
after a restart: *excluded*), and a group
trains on N valid rewards (paper §2.3, §5.2), so k extra executions are launched up front
and the surplus is cancelled once the group has what it needs (§4.2: every launched
execution terminates once, "including surplus executions under oversampling"):

* each terminated execution's outcome settles once (`Assessed(x, valid)`); *valid* is every
  outcome training can use (a score, a failure placeholder), *excluded* the rest;
* the group is complete as soon as N of its executions settled valid, or once all N + k
  settled; its members are then fixed by `trained_members`: the first N valid in the order
  they settled — filled up with excluded ones, in the same order, when fewer than N are
  valid (the packing buffer takes N outcomes and leaves excluded ones out, as without
  oversampling);
* the other executions are surplus: running ones are cancelled, queued ones withdrawn (they
  never launch), closed ones are recorded and never trained.

With k = 0 a group is complete when all its N executions settled and all N are members:
Gyre without oversampling. `Groups` is the scheduler's book of this, pure (no I/O, no
clock); the scheduler turns what it reports into actions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gyre.errors import SchedulerError
from gyre.schedule.config import ScheduleConfig

QUEUED, RUNNING, CLOSED, SETTLED, WITHDRAWN = range(5)
"""An execution's state: dispatched, launched, terminated, outcome settled, never launched."""
_STATE = ("queued", "running", "terminated", "settled", "withdrawn")


def trained_members(settled: Iterable[tuple[int, bool]], n: int) -> tuple[int, ...]:
    """The N members of a group whose outcomes settled in this order ((execution, valid)):
    the first N valid, filled up with the first excluded ones, in ascending id order."""
    order = list(settled)
    chosen = [x for x, valid in order if valid][:n]
    chosen += [x for x, valid in order if not valid][: n - len(chosen)]
    return tuple(sorted(chosen))


@dataclass(slots=True)
class Group:
    """One dispatched group: its dispatch version and how far its executions got."""

    version: int
    """v_d: the published version when the group was dispatched."""
    first: int
    """Its first execution id."""
    closed: int = 0
    """Executions terminated (withdrawn ones not included)."""
    excluded: int = 0
    """Executions whose outcome settled excluded."""
    settled: list[tuple[int, bool]] = field(default_factory=list)
    """(execution, valid) in the order the outcomes settled, until the group is complete."""
    members: tuple[int, ...] | None = None
    """The executions that train, fixed when the group completes (() for a carried group)."""

    @property
    def complete(self) -> bool:
        return self.members is not None


class Groups:
    """Every group of a run, in dispatch order (index = group id)."""

    def __init__(self, schedule: ScheduleConfig) -> None:
        self.n = schedule.group_size
        self.size = schedule.executions_per_group
        self.groups: list[Group] = []
        self.state = bytearray()  # per execution
        self.soon_ready = 0
        """Groups for which `soon` holds (R_soon of the supply check), kept per event."""

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, g: int) -> Group:
        return self.groups[g]

    def group_of(self, x: int) -> int:
        return x // self.size

    def executions(self, g: int) -> range:
        first = self.groups[g].first
        return range(first, first + self.size)

    def dispatch(self, version: int) -> tuple[int, ...]:
        """A new group of N + k queued executions, dispatched at `version`."""
        first = len(self.state)
        self.groups.append(Group(version=version, first=first))
        self.state.extend(bytes(self.size))
        return tuple(range(first, first + self.size))

    def carry(self, version: int) -> int:
        """A resumed job's group: closed, settled and complete already (its driver knows
        which executions train: its members are ())."""
        self.dispatch(version)
        g = self.groups[-1]
        g.closed, g.members = self.size, ()
        self.state[g.first :] = bytes([SETTLED]) * self.size
        return len(self.groups) - 1

    def launch(self, x: int) -> None:
        self.state[x] = RUNNING

    def terminate(self, x: int) -> None:
        """A running execution ended (the scheduler checked that it ran)."""
        g = self.group_of(x)
        was = self.soon(g)
        self.state[x] = CLOSED
        self.groups[g].closed += 1
        self.soon_ready += self.soon(g) - was

    def assess(self, x: int, valid: bool) -> bool:
        """Settle a terminated execution's outcome; True if that completed its group."""
        state = self.state[x] if 0 <= x < len(self.state) else None
        if state != CLOSED:
            what = "no such execution" if state is None else _STATE[state]
            raise SchedulerError(
                f"Assessed: execution {x} is not terminated and unsettled ({what})"
            )
        self.state[x] = SETTLED
        g = self.group_of(x)
        group = self.groups[g]
        if group.complete:  # a surplus execution settling late: recorded, never trained
            return False
        was = self.soon(g)
        group.excluded += not valid
        group.settled.append((x, valid))
        valid_count = len(group.settled) - group.excluded
        if valid_count == self.n or len(group.settled) == self.size:
            group.members = trained_members(group.settled, self.n)
            group.settled = []
        self.soon_ready += self.soon(g) - was
        return group.complete

    def soon(self, g: int) -> bool:
        """Not complete, and enough executions closed that it may complete on outcomes alone:
        N closed that are not known excluded, or all N + k closed (R_soon's groups)."""
        group = self.groups[g]
        if group.complete:
            return False
        return group.closed - group.excluded >= self.n or group.closed == self.size

    def surplus(self, g: int) -> tuple[list[int], list[int]]:
        """A complete group's (running, queued) executions: to cancel, and to withdraw (they
        are marked withdrawn here)."""
        running, queued = [], []
        for x in self.executions(g):
            if self.state[x] == RUNNING:
                running.append(x)
            elif self.state[x] == QUEUED:
                self.state[x] = WITHDRAWN
                queued.append(x)
        return running, queued
