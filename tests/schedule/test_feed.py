"""The feed loop (`gyre.schedule.Feed`) against a slow, obvious reference.

A scripted scheduler answers each event with actions of two types; carrying out an action
may raise further events (as AdmitGroup raises MicroStepsQueued). The reference is a plain
FIFO queue: an event is handled, all its actions are carried out, `after` runs, and only then
does the next raised event get its turn — in the order the events were raised. Hypothesis
draws the scripts (which action raises which events); the log of what the `Feed` did must
equal the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.schedule.feed import Feed

Log = list[tuple[Any, ...]]


@dataclass(frozen=True)
class Raises:
    """An action that, carried out, raises `events` (by id)."""

    event: int
    index: int
    events: tuple[int, ...]


@dataclass(frozen=True)
class Quiet:
    """An action that raises nothing (a second type: dispatch goes by type)."""

    event: int
    index: int


# script[e]: the actions event e is answered with, each the events it raises
Script = list[list[tuple[int, ...]]]


class ScriptedScheduler:
    def __init__(self, script: Script, log: Log) -> None:
        self.script, self.log = script, log

    def handle(self, event: int) -> list[Raises | Quiet]:
        self.log.append(("handle", event))
        return [Raises(event, i, raised) if raised else Quiet(event, i)
                for i, raised in enumerate(self.script[event])]  # fmt: skip


@dataclass
class Driver:
    log: Log
    feed: Feed[Driver] | None = field(default=None)

    def raises(self, a: Raises) -> None:
        self.log.append(("action", a.event, a.index))
        assert self.feed is not None
        for e in a.events:
            self.feed(e)

    def quiet(self, a: Quiet) -> None:
        self.log.append(("quiet", a.event, a.index))

    def after(self) -> None:
        self.log.append(("after",))


ACTIONS = {Raises: Driver.raises, Quiet: Driver.quiet}


def reference(script: Script, fed: list[int]) -> Log:
    """What feeding `fed` (one after another, from outside) must do, slowly and obviously."""
    log: Log = []
    for first in fed:
        queue = [first]
        while queue:
            event = queue.pop(0)
            log.append(("handle", event))
            for i, raised in enumerate(script[event]):
                log.append(("action", event, i) if raised else ("quiet", event, i))
                queue.extend(raised)
            log.append(("after",))
    return log


@st.composite
def scripts(draw: st.DrawFn) -> tuple[Script, list[int]]:
    """A forest of events: each event but the roots is raised by one action of an earlier
    event (so every feed ends); the roots are fed from outside, in order."""
    n = draw(st.integers(1, 25))
    actions = [draw(st.integers(0, 3)) for _ in range(n)]
    raised: list[list[list[int]]] = [[[] for _ in range(k)] for k in actions]
    roots = [0]
    for e in range(1, n):
        parents = [p for p in range(e) if actions[p]]
        if not parents or draw(st.integers(0, 5)) == 0:
            roots.append(e)
            continue
        p = draw(st.sampled_from(parents))
        raised[p][draw(st.integers(0, actions[p] - 1))].append(e)
    return [[tuple(r) for r in per_event] for per_event in raised], roots


@settings(max_examples=300, deadline=None)
@given(scripts())
def test_raised_events_wait_for_the_current_one_and_keep_their_order(
    drawn: tuple[Script, list[int]],
) -> None:
    script, roots = drawn
    log: Log = []
    driver = Driver(log)
    driver.feed = Feed(ScriptedScheduler(script, log), ACTIONS, driver, after=driver.after)
    for root in roots:
        driver.feed(root)
    assert log == reference(script, roots)
    assert not driver.feed.pending and not driver.feed.feeding


def test_without_after_the_actions_alone_run() -> None:
    log: Log = []
    driver = Driver(log)
    driver.feed = Feed(ScriptedScheduler([[(1,), ()], []], log), ACTIONS, driver)
    driver.feed(0)
    assert log == [("handle", 0), ("action", 0, 0), ("quiet", 0, 1), ("handle", 1)]


def test_the_scheduler_is_asked_at_each_event_not_at_construction() -> None:
    """A wrapped `handle` (tests/sim/test_sim_counters.py logs every event this way) sees
    every event fed after it was wrapped."""
    log: Log = []
    driver = Driver(log)
    scheduler = ScriptedScheduler([[(1,)], []], log)
    driver.feed = Feed(scheduler, ACTIONS, driver)
    seen: list[int] = []
    handle = scheduler.handle
    scheduler.handle = lambda e: (seen.append(e), handle(e))[1]  # type: ignore[method-assign]
    driver.feed(0)
    assert seen == [0, 1]
