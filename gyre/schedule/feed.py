"""The feed loop: how a driver hands the scheduler one event and carries out its actions.

The coordinator (`gyre.runtime.coordinator`) and the simulator (`gyre.sim`) drive the same
pure scheduler the same way, through this one loop: the scheduler handles an event and
returns its actions, and each action is carried out by its type, through the driver's table
of handlers. Carrying out an action may raise a new event (AdmitGroup -> MicroStepsQueued;
in the simulator, Cancel -> Terminated): it waits until every action of the current event is
done, then is handled in turn, so events are handled one at a time, in the order they were
raised. `after` runs once each event's actions are done (the coordinator sends the drains
its fleet owes the proxy and records the cells' roles). Pure: no I/O, no clock.

    feed = Feed(scheduler, {ev.Launch: Driver.launch, ...}, driver, after=driver.step)
    feed(ev.Start())
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from gyre.schedule.events import Event
from gyre.schedule.machine import Scheduler

D = TypeVar("D")


class Feed(Generic[D]):
    """`feed(event)`: `scheduler.handle(event)`, each action carried out by
    `actions[type(action)](driver, action)`; re-entrant (a raised event waits its turn)."""

    __slots__ = ("actions", "after", "driver", "feeding", "pending", "scheduler")

    def __init__(
        self,
        scheduler: Scheduler,
        actions: Mapping[type, Callable[[D, Any], None]],
        driver: D,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler, self.actions, self.driver, self.after = scheduler, actions, driver, after
        self.pending: deque[Event] = deque()  # raised by an action, not yet handled
        self.feeding = False  # an event's actions are being carried out

    def __call__(self, event: Event) -> None:
        if self.feeding:
            self.pending.append(event)
            return
        self.feeding = True
        handle, actions, driver, pending = (
            self.scheduler.handle, self.actions, self.driver, self.pending
        )  # fmt: skip
        try:
            while True:
                for action in handle(event):
                    actions[type(action)](driver, action)
                if self.after is not None:
                    self.after()
                if not pending:
                    return
                event = pending.popleft()
        finally:
            self.feeding = False
