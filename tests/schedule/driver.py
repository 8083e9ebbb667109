"""A tiny random 'world' that answers the scheduler's actions in arbitrary order (tests only).

It holds every outstanding obligation (running executions, outcomes to settle — each valid
with probability `valid_p`, else excluded —, packing, claimed micro-step passes, prepassed
micro-steps whose gradient pass is not yet ready, switches, updates, publications) and
fulfils one chosen by `rng` per step, checking the scheduler's invariants after each event.
A cancelled surplus execution keeps running until the world gets to it (then it ends
CANCELLED), and its outcome still settles, as in a run.
"""

from __future__ import annotations

import random
from typing import Any

from gyre.schedule import events as ev
from gyre.schedule.machine import Phase, Scheduler
from gyre.vocabulary import Outcome

from .reference import JoinReference


class World:
    def __init__(self, scheduler: Scheduler, rng: random.Random, valid_p: float = 1.0) -> None:
        self.s = scheduler
        self.rng = rng
        self.valid_p = valid_p
        self.running: list[int] = []
        self.unsettled: list[int] = []  # terminated executions whose outcome is not settled
        self.cancelled: set[int] = set()
        self.withdrawn: set[int] = set()
        self.packing: list[tuple[int, int]] = []
        self.micro: list[tuple[int, int, ev.Work, int]] = []  # cell, batch, work, window
        self.unready: list[int] = []  # batch of each prepassed micro-step not yet ready
        self.switching: list[int] = []
        self.update: list[int] = []
        self.publish: list[int] = []
        self.staleness: list[int] = []
        self.bursts_done = 0
        self.log: list[ev.Action] = []
        self.terminated: set[int] = set()
        self.window_open: dict[int, bool] = {}
        self.snapshots: list[tuple[int, int]] = []  # (bursts done, Σ v_d of unconsumed groups)
        self.admitted: set[int] = set()
        self.versions: dict[int, int] = {}
        self.publications = 0
        self.ref = JoinReference(scheduler.config, scheduler.policy)

    def feed(self, event: ev.Event) -> None:
        self.ref.on_event(event)
        for action in self.s.handle(event):
            complaint = self.ref.on_action(action)
            assert complaint is None, complaint
            self.apply(action)
        check_invariants(self.s, self)
        missed = self.ref.missed_join(self.s.phase is Phase.BURST)
        assert missed is None, missed
        assert self.s.wasted_switches == self.ref.wasted

    def seconds(self, high: float) -> float | None:
        """A measured duration, or none (drivers may leave it out)."""
        return None if self.rng.random() < 0.2 else self.rng.uniform(0.0, high)

    def apply(self, a: ev.Action) -> None:
        self.log.append(a)
        if isinstance(a, ev.Dispatch):
            self.versions[a.group] = a.version
            assert a.version == self.s.published
        elif isinstance(a, ev.Launch):
            assert self.s.engines[a.engine].up, f"launch on lost engine {a.engine}"
            self.running.append(a.execution)
        elif isinstance(a, ev.Cancel):
            self.cancelled.add(a.execution)
        elif isinstance(a, ev.Withdraw):
            self.withdrawn.add(a.execution)
        elif isinstance(a, ev.SwitchCell):
            self.switching.append(a.cell)
        elif isinstance(a, ev.AdmitGroup):
            self.staleness.append(a.staleness)
            self.admitted.add(a.group)
            self.packing.append((a.batch, a.group))
        elif isinstance(a, ev.ClaimMicroStep):
            assert self.s.roles[a.cell].value == "train"
            if a.work is ev.Work.GRADIENT:
                assert a.cell < len(self.s.update_cells()), "gradient claim outside the prefix"
            assert 1 <= a.count <= self.s.window, f"{a!r}: window {self.s.window}"
            self.micro.append((a.cell, a.batch, a.work, a.count))
        elif isinstance(a, ev.OpenJoinWindow):
            self.window_open[a.batch] = True
        elif isinstance(a, ev.CloseJoinWindow):
            self.window_open[a.batch] = False
        elif isinstance(a, ev.OptimizerUpdate):
            assert self.window_open[a.batch] is False, "join window must close before the update"
            assert 0 in a.cells, "the core takes part in every update"
            assert a.cells == tuple(range(len(a.cells))), f"update cells {a.cells}: not a prefix"
            assert all(self.s.roles[c].value == "train" for c in a.cells)
            self.update.append(a.batch)
        elif isinstance(a, ev.Publish):
            self.publish.append(a.version)

    def step(self) -> bool:
        """Fulfil one random obligation; False when nothing is outstanding.

        Now and then an engine dies, or a dead one comes back (as the runtime reports it).
        """
        if self.rng.random() < 0.03 and self.s.started:
            e = self.rng.randrange(len(self.s.engines))
            down = not self.s.engines[e].up
            self.feed(ev.EngineRestored(e) if down else ev.EngineLost(e))
        pools: list[list[Any]] = [
            p
            for p in (
                self.running,
                self.unsettled,
                self.packing,
                self.micro,
                self.unready,
                self.switching,
                self.update,
                self.publish,
            )
            if p
        ]
        if not pools:
            down = [e for e in self.s.engines if not e.up]
            if down:  # nothing moves while engines are lost: one comes back
                self.feed(ev.EngineRestored(down[0].index))
                return True
            return False
        pool = self.rng.choice(pools)
        item = pool.pop(self.rng.randrange(len(pool)))
        if pool is self.running:
            self._terminate(item)
        elif pool is self.unsettled:
            self.feed(ev.Assessed(item, valid=self.rng.random() < self.valid_p))
        elif pool is self.packing:
            batch, group = item
            self.feed(ev.MicroStepsQueued(batch=batch, group=group, count=self.rng.randrange(4)))
        elif pool is self.micro:
            cell, batch, work, count = item
            if work is ev.Work.PREPASS:
                self.unready += [batch] * count
            self.feed(ev.MicroStepDone(cell=cell, batch=batch, seconds=self.seconds(30.0)))
        elif pool is self.unready:  # release it and any others of its batch, at random
            extra = [b for b in self.unready if b == item and self.rng.random() < 0.5]
            for b in extra:
                self.unready.remove(b)
            self.feed(ev.GradientsReady(batch=item, count=1 + len(extra)))
        elif pool is self.switching:
            self.feed(ev.SwitchDone(item, seconds=self.seconds(20.0)))
        elif pool is self.update:
            self.feed(ev.BatchDone(item))
            if self.s.step_in_burst == self.s.config.mu or self.s.phase.value == "ending":
                self.bursts_done += 1
                unconsumed = [g for g in self.versions if g not in self.admitted]
                self.snapshots.append((self.bursts_done, sum(self.versions[g] for g in unconsumed)))
        elif pool is self.publish:
            self.feed(ev.WeightsPublished(item))
            self.publications += 1
        return True

    def _terminate(self, x: int) -> None:
        outcome = Outcome.CANCELLED if x in self.cancelled else self.rng.choice(list(Outcome))
        self.terminated.add(x)
        self.feed(ev.Terminated(x, outcome))
        self.unsettled.append(x)


def check_invariants(s: Scheduler, world: World) -> None:
    """Counter, capacity, routing and ordering invariants of docs/scheduler.md."""
    assert 0 <= s.f <= s.p <= s.d
    assert s.p - s.f == len(s.route) == sum(len(e.running) for e in s.engines)
    assert s.d - s.p == len(s.queue)
    assert s.f == len(world.terminated) + s.withdrawn and s.withdrawn == len(world.withdrawn)
    complaint = world.ref.groups.check(set(s.queue), set(world.running))
    assert complaint is None, complaint
    assert s.soon_ready == world.ref.groups.soon()
    for e in s.engines:
        assert len(e.running) <= e.capacity
        if e.running:
            assert e.accepting, f"executions left on non-rollout engine {e.index}"
    if s.policy.name == "elastic" and s.phase.value == "burst":
        # during a burst the cells training or joining form a prefix (core first)
        training = [c for c, r in enumerate(s.roles) if r.value in ("train", "to_train")]
        assert training == list(range(len(training))), f"not a prefix: {s.roles}"
    if s.policy.name == "async":
        for c, r in enumerate(s.roles):
            assert (r.value == "train") == (c in s.policy.fixed_train)
