"""Oversampling at the coordinator (docs/scheduler.md "Oversampling"): the surplus and the
executions it replaced.

With `schedule.oversample` k > 0 each group runs N + k executions and trains the N members
the scheduler names; the rest of the group is surplus. The scheduler decides; this is what
the coordinator does about it and what a user sees of it:

    cancel    -> a running surplus execution stops at the proxy node (it still closes and is
                 scored, never trained); a `surplus` event, `surplus_cancelled`
    withdraw  -> a queued one is closed in the trace as never launched; a `surplus` event,
                 `surplus_withdrawn`
    admitted  -> the `admit` event's `members` and `surplus`; each excluded execution of a
                 group that still trains N valid members was replaced: a `replaced` event,
                 `excluded_replaced` (checked again for a verdict that comes after admission)

Without oversampling (k = 0) none of this writes anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre.runtime.coordinator import resume
from gyre.runtime.coordinator.ledger import Ledger
from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.shared import messages as msg
from gyre.schedule import events as ev
from gyre.vocabulary import CloseStatus

# how a surplus execution closes: cancelled while it ran, or withdrawn before it launched
SURPLUS = (CloseStatus.CANCELLED, CloseStatus.NOT_LAUNCHED)


class Oversampling:
    """The surplus of groups of N + k (`ledger`), recorded in `rec` and counted in `stats`."""

    def __init__(
        self, n: int, ledger: Ledger, rec: RunRecorder, stats: dict[str, Any],
        to_proxy: Callable[[msg.Message], None],
    ) -> None:  # fmt: skip
        self.n, self.ledger, self.rec, self.stats, self.to_proxy = n, ledger, rec, stats, to_proxy
        self.on = ledger.n > n  # k > 0
        stats.update(surplus_cancelled=0, surplus_withdrawn=0, excluded_replaced=0)

    def cancel(self, a: ev.Cancel) -> None:
        """A surplus execution: its group has its N members; it still closes and is scored."""
        x = self.ledger.executions[a.execution]
        self.stats["surplus_cancelled"] += 1
        self.rec.event("surplus", execution=x.id, group=self.ledger.group_of(a.execution).id,
                       action="cancel")  # fmt: skip
        self.to_proxy(msg.Cancel([x.id]))

    def withdraw(self, a: ev.Withdraw) -> None:
        """A surplus execution that never launched: closed in the trace as not launched."""
        self.stats["surplus_withdrawn"] += 1
        g = self.ledger.group_of(a.execution)
        self.rec.event("surplus", execution=self.ledger.executions[a.execution].id, group=g.id,
                       action="withdraw")  # fmt: skip
        resume.close_not_launched(self.ledger, self.rec, a.execution,
                                  f"surplus: group {g.id} had its {self.n} members first")  # fmt: skip

    def split(self, group: int, members: tuple[int, ...]) -> dict[str, list[str]]:
        """The `admit` event's members and surplus (execution ids); nothing without."""
        if not self.on:
            return {}
        xs = self.ledger.executions
        return {"members": [xs[i].id for i in members],
                "surplus": [xs[i].id for i in self.ledger.indices(group) if i not in members]}  # fmt: skip

    def admitted(self, group: int) -> None:
        """The group trains: record each of its executions that oversampling replaced."""
        for i in self.ledger.indices(group):
            self.replaced(i)

    def replaced(self, i: int) -> None:
        """Record an excluded execution (not a cancelled or withdrawn surplus one) whose group
        trains N valid members: oversampling replaced it. Checked when its group is admitted
        and, for a verdict that comes later, when it closes."""
        x = self.ledger.executions[i]
        g = self.ledger.groups[x.group]
        if not self.on or g.trained is None or i in g.trained:
            return
        if x.verdict is None or x.verdict.usable or x.outcome in SURPLUS:
            return
        verdicts = [self.ledger.executions[j].verdict for j in g.trained]
        if all(v is not None and v.usable for v in verdicts):
            self.stats["excluded_replaced"] += 1
            self.rec.event("replaced", execution=x.id, group=g.id)
