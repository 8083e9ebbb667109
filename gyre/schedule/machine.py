"""The scheduler: one pure state machine for Elastic, Async and Colocate placement.

`Scheduler(config, policy).handle(event) -> list[Action]` is the whole interface. It keeps no
clock, does no I/O and starts no threads; the coordinator (over MPI) and the simulator (over
an event queue) feed it the same events and carry out the same actions. The equations it
implements are written down in docs/scheduler.md:

* counters d(t) >= p(t) >= f(t) >= 0 (dispatched, launched, terminated executions) and the
  waterlevel W = d - f (queued + running);
* boundary dispatch: (φ+μ)B groups at start, μB after each burst's publication;
* a switch unit leaves rollout when the remaining rollout capacity still serves every
  outstanding execution, C_R - C_u >= W, and (core) the supply check passes or (satellite)
  enough micro-steps remain in the open batch;
* streaming batches: ready groups are admitted oldest version first, cells claim micro-steps,
  the join window closes before the single optimizer update;
* burst end: satellites return, the core publishes, then stays only if the next burst's
  supply check and C_R >= W hold.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import SchedulerError
from gyre.schedule.config import Config
from gyre.schedule.events import (
    Action,
    AdmitGroup,
    BatchDone,
    ClaimMicroStep,
    CloseJoinWindow,
    Dispatch,
    Event,
    GroupReady,
    Launch,
    Launched,
    MicroStepDone,
    MicroStepsQueued,
    OpenJoinWindow,
    OptimizerUpdate,
    Publish,
    Reroute,
    Role,
    Start,
    SwitchCell,
    SwitchDone,
    Terminated,
    Tick,
    WeightsPublished,
)
from gyre.schedule.policy import Policy


class Phase(enum.Enum):
    """Where the core is in the burst cycle."""

    IDLE = "idle"  # no burst: waiting for the supply check / waterlevel
    BURST = "burst"  # the core (unit 0) trains the burst's μ steps
    ENDING = "ending"  # last update done: satellites returning, then publication


@dataclass(slots=True)
class Engine:
    """A rollout engine: a cell's (while it is in ROLLOUT) or a standalone one."""

    index: int
    cell: int | None
    capacity: int
    running: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Batch:
    """The batch being trained: B groups streamed in as micro-steps."""

    index: int
    admitted: int = 0
    packed: int = 0
    queued: int = 0
    claimed: int = 0
    done: int = 0
    window_open: bool = True
    updating: bool = False


class Scheduler:
    """Events in, actions out; see the module docstring and docs/scheduler.md."""

    def __init__(self, config: Config, policy: Policy) -> None:
        self.config = config
        self.policy = policy
        k, cap = config.cells, config.concurrency_per_cell
        self.roles = [Role.ROLLOUT] * k
        for c in policy.fixed_train:
            self.roles[c] = Role.TRAIN
        self.engines = [Engine(i, i, cap) for i in range(k)]
        self.engines += [Engine(k + j, None, cap) for j in range(config.standalone_engines)]
        # §4.3: standalone engines first, then rollout cells in descending cell order.
        self.reroute_order = self.engines[k:] + self.engines[k - 1 :: -1]
        self.d = self.p = self.f = 0
        self.version = 0  # v: optimizer updates applied so far
        self.published = 0  # latest published version (recorded at dispatch)
        self.group_version: list[int] = []
        self.group_closed: list[int] = []
        self.route: dict[int, int] = {}  # running execution -> engine
        self.queue: deque[int] = deque()
        self.ready: list[tuple[int, int]] = []  # heap of (v_d, group): oldest version first
        self.soon_ready = 0  # groups with all N terminated, outcome not settled yet
        self.batch: Batch | None = None
        self.batches_opened = 0
        self.step_in_burst = 0
        self.phase = Phase.IDLE
        self.publishing = False
        self.started = False
        self.busy = [False] * k
        self.microsteps_packed = 0
        self.groups_packed = 0
        self._handlers: dict[type, Callable[[Any, list[Action]], None]] = {
            Start: self._on_start,
            Launched: self._on_launched,
            Terminated: self._on_terminated,
            GroupReady: self._on_group_ready,
            MicroStepsQueued: self._on_microsteps_queued,
            MicroStepDone: self._on_microstep_done,
            BatchDone: self._on_batch_done,
            SwitchDone: self._on_switch_done,
            WeightsPublished: self._on_weights_published,
            Tick: lambda e, out: None,
        }

    # ------------------------------------------------------------------ public state

    @property
    def waterlevel(self) -> int:
        """W(t) = d(t) - f(t): queued plus running executions."""
        return self.d - self.f

    @property
    def rollout_capacity(self) -> int:
        """C_R: concurrency of the engines that accept executions now."""
        return sum(e.capacity for e in self.engines if self._accepting(e))

    def training_cells(self) -> tuple[int, ...]:
        return tuple(c for c, r in enumerate(self.roles) if r is Role.TRAIN)

    def update_cells(self) -> tuple[int, ...]:
        """The cells of an optimizer update: the longest prefix 0..m-1 that is in TRAIN.

        Units leave in order, but their switches may finish out of order (a cell whose
        engine drains slowly is still TO_TRAIN while a later one is in TRAIN); the
        reduction runs over a prebuilt prefix communicator, so a later cell waits out this
        update (its claimed micro-steps were phase A only, and phase B is reassigned).
        """
        m = 0
        while m < len(self.roles) and self.roles[m] is Role.TRAIN:
            m += 1
        return tuple(range(m))

    # ------------------------------------------------------------------ entry point

    def handle(self, event: Event) -> list[Action]:
        """Apply one event and return the actions it makes due, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise SchedulerError(f"unknown event {event!r}")
        if not self.started and not isinstance(event, Start):
            raise SchedulerError(f"{event!r} before Start")
        out: list[Action] = []
        handler(event, out)
        self._advance(out)
        return out

    # ------------------------------------------------------------------ event handlers

    def _on_start(self, event: Start, out: list[Action]) -> None:
        if self.started:
            raise SchedulerError("Start received twice")
        self.started = True
        cfg = self.config
        self._dispatch(cfg.extra_groups + cfg.mu * cfg.batch_groups, out)

    def _on_launched(self, event: Launched, out: list[Action]) -> None:
        if event.execution not in self.route:
            raise SchedulerError(f"Launched: execution {event.execution} is not running")

    def _on_terminated(self, event: Terminated, out: list[Action]) -> None:
        x = event.execution
        engine = self.route.pop(x, None)
        if engine is None:
            raise SchedulerError(f"Terminated: execution {x} is not running (f counts once)")
        self.engines[engine].running.discard(x)
        self.f += 1
        g = x // self.config.group_size
        self.group_closed[g] += 1
        if self.group_closed[g] == self.config.group_size:
            self.soon_ready += 1

    def _on_group_ready(self, event: GroupReady, out: list[Action]) -> None:
        g = event.group
        if not 0 <= g < len(self.group_closed) or self.group_closed[g] != self.config.group_size:
            raise SchedulerError(f"GroupReady: group {g} still has running executions")
        self.group_closed[g] += 1  # N + 1 marks "ready"; a second GroupReady is an error
        self.soon_ready -= 1
        heapq.heappush(self.ready, (self.group_version[g], g))

    def _on_microsteps_queued(self, event: MicroStepsQueued, out: list[Action]) -> None:
        batch = self._current(event.batch, "MicroStepsQueued")
        if batch.packed >= batch.admitted or event.count < 0:
            raise SchedulerError(f"MicroStepsQueued: unexpected {event!r}")
        batch.packed += 1
        batch.queued += event.count
        self.groups_packed += 1
        self.microsteps_packed += event.count

    def _on_microstep_done(self, event: MicroStepDone, out: list[Action]) -> None:
        batch = self._current(event.batch, "MicroStepDone")
        if not self.busy[event.cell]:
            raise SchedulerError(f"MicroStepDone: cell {event.cell} claimed nothing")
        self.busy[event.cell] = False
        batch.done += 1

    def _on_batch_done(self, event: BatchDone, out: list[Action]) -> None:
        batch = self._current(event.batch, "BatchDone")
        if not batch.updating:
            raise SchedulerError(f"BatchDone: batch {batch.index} has no update running")
        self.batch = None
        self.version += 1
        self.step_in_burst += 1
        if self.step_in_burst == self.config.mu:
            self.phase = Phase.ENDING
            for c in self._satellites():
                if self.roles[c] is Role.TRAIN:
                    self._switch_cell(c, Role.ROLLOUT, out)

    def _on_switch_done(self, event: SwitchDone, out: list[Action]) -> None:
        c = event.cell
        if self.roles[c] is Role.TO_TRAIN:
            self.roles[c] = Role.TRAIN
            late = c in self._satellites() and self.phase is not Phase.BURST
            if late or (self.policy.switches and self.phase is Phase.IDLE):
                self._switch_cell(c, Role.ROLLOUT, out)  # the burst it switched for is over
        elif self.roles[c] is Role.TO_ROLLOUT:
            self.roles[c] = Role.ROLLOUT
        else:
            raise SchedulerError(f"SwitchDone: cell {c} is not switching ({self.roles[c].value})")

    def _on_weights_published(self, event: WeightsPublished, out: list[Action]) -> None:
        if not self.publishing or event.version != self.version:
            raise SchedulerError(f"WeightsPublished: no publication of version {event.version}")
        self.publishing = False
        self.published = event.version
        self.phase = Phase.IDLE
        self.step_in_burst = 0
        self._dispatch(self.config.mu * self.config.batch_groups, out)
        if self.policy.switches and self.roles[0] is Role.TRAIN:
            if self._supply_ok() and self.rollout_capacity >= self.waterlevel:
                self.phase = Phase.BURST  # core retention
            else:  # cells still arriving (TO_TRAIN) turn back on their SwitchDone
                for c in self.policy.units[0]:
                    if self.roles[c] is Role.TRAIN:
                        self._switch_cell(c, Role.ROLLOUT, out)

    # ------------------------------------------------------------------ decisions

    def _advance(self, out: list[Action]) -> None:
        self._launch(out)
        if self.phase is Phase.IDLE:
            self._maybe_start_burst(out)
        if self.phase is Phase.BURST:
            self._maybe_open_batch(out)
            self._admit(out)
            self._maybe_join(out)
            self._claim(out)
            self._maybe_update(out)
        if self.phase is Phase.ENDING:
            self._maybe_publish(out)
        self._launch(out)

    def _maybe_start_burst(self, out: list[Action]) -> None:
        if not self._supply_ok():
            return
        if not self.policy.switches:
            self.phase = Phase.BURST
            return
        unit = self.policy.units[0]
        if all(self.roles[c] is Role.ROLLOUT for c in unit) and self._waterlevel_ok(unit):
            for c in unit:
                self._switch_cell(c, Role.TRAIN, out)
            self.phase = Phase.BURST

    def _maybe_open_batch(self, out: list[Action]) -> None:
        if self.batch is not None or self.roles[0] is not Role.TRAIN:
            return
        if not self.policy.streaming and len(self.ready) < self.config.batch_groups:
            return
        self.batch = Batch(index=self.batches_opened)
        self.batches_opened += 1
        out.append(OpenJoinWindow(self.batch.index))

    def _admit(self, out: list[Action]) -> None:
        batch = self.batch
        if batch is None:
            return
        while self.ready and batch.admitted < self.config.batch_groups:
            v_d, g = heapq.heappop(self.ready)
            batch.admitted += 1
            out.append(AdmitGroup(group=g, batch=batch.index, staleness=self.version - v_d))

    def _maybe_join(self, out: list[Action]) -> None:
        batch = self.batch
        if batch is None or not batch.window_open or len(self.policy.units) < 2:
            return
        for unit in self.policy.units[1:]:
            role = self._unit_role(unit)
            if role is Role.TRAIN or role is Role.TO_TRAIN:
                continue
            if role is not Role.ROLLOUT:
                return  # still returning from an earlier burst: keep the cell order
            if not self._waterlevel_ok(unit):
                return
            if self._remaining_microsteps(batch) < self.config.join_min_microsteps:
                return
            for c in unit:
                self._switch_cell(c, Role.TRAIN, out)

    def _unit_role(self, unit: tuple[int, ...]) -> Role | None:
        """The unit's role if all its cells share it (TRAIN counts with TO_TRAIN), else None."""
        first = self.roles[unit[0]]
        training = (Role.TRAIN, Role.TO_TRAIN)
        for c in unit[1:]:
            role = self.roles[c]
            if role is not first and not (role in training and first in training):
                return None
        return first

    def _claim(self, out: list[Action]) -> None:
        batch = self.batch
        if batch is None:
            return
        for c, role in enumerate(self.roles):
            if batch.claimed == batch.queued:
                return
            if role is Role.TRAIN and not self.busy[c]:
                self.busy[c] = True
                batch.claimed += 1
                out.append(ClaimMicroStep(cell=c, batch=batch.index))

    def _maybe_update(self, out: list[Action]) -> None:
        batch = self.batch
        b = self.config.batch_groups
        if batch is None or batch.packed < b or batch.claimed < batch.queued:
            return
        if batch.window_open:
            batch.window_open = False
            out.append(CloseJoinWindow(batch.index))
        if batch.done == batch.queued and not batch.updating:
            batch.updating = True
            out.append(OptimizerUpdate(batch=batch.index, cells=self.update_cells()))

    def _maybe_publish(self, out: list[Action]) -> None:
        if self.publishing:
            return
        if any(self.roles[c] is not Role.ROLLOUT for c in self._satellites()):
            return
        self.publishing = True
        engines = tuple(e.index for e in self.engines if self._accepting(e))
        out.append(Publish(version=self.version, engines=engines))

    # ------------------------------------------------------------------ mechanics

    def _dispatch(self, groups: int, out: list[Action]) -> None:
        n = self.config.group_size
        for _ in range(groups):
            g = len(self.group_version)
            executions = tuple(range(g * n, (g + 1) * n))
            self.group_version.append(self.published)
            self.group_closed.append(0)
            self.queue.extend(executions)
            self.d += n
            out.append(Dispatch(group=g, executions=executions, version=self.published))

    def _launch(self, out: list[Action]) -> None:
        if not self.queue:
            return
        open_engines = [e for e in self.engines if self._accepting(e)]
        while self.queue:
            best = max(open_engines, key=lambda e: e.capacity - len(e.running), default=None)
            if best is None or len(best.running) >= best.capacity:
                return
            x = self.queue.popleft()
            best.running.add(x)
            self.route[x] = best.index
            self.p += 1
            out.append(Launch(execution=x, engine=best.index))

    def _switch_cell(self, c: int, role: Role, out: list[Action]) -> None:
        if role is Role.TRAIN:
            self.roles[c] = Role.TO_TRAIN
            out.append(SwitchCell(cell=c, role=Role.TRAIN))
            self._reroute(self.engines[c], out)
        else:
            self.roles[c] = Role.TO_ROLLOUT
            out.append(SwitchCell(cell=c, role=Role.ROLLOUT))

    def _reroute(self, source: Engine, out: list[Action]) -> None:
        """Source stops accepting; reserve destinations; calls are cancelled and retried."""
        for x in sorted(source.running):
            dest = next(
                (
                    e
                    for e in self.reroute_order
                    if self._accepting(e) and len(e.running) < e.capacity
                ),
                None,
            )
            if dest is None:
                raise SchedulerError(f"no rollout capacity left to reroute execution {x}")
            dest.running.add(x)
            self.route[x] = dest.index
            out.append(Reroute(execution=x, source=source.index, destination=dest.index))
        source.running.clear()

    # ------------------------------------------------------------------ checks

    def _accepting(self, engine: Engine) -> bool:
        return engine.cell is None or self.roles[engine.cell] is Role.ROLLOUT

    def _waterlevel_ok(self, unit: tuple[int, ...]) -> bool:
        """C_R - C_u >= W: the engines left in rollout still serve every outstanding execution."""
        staying = sum(
            e.capacity
            for e in self.engines
            if e.cell is None or (self.roles[e.cell] is Role.ROLLOUT and e.cell not in unit)
        )
        return staying >= self.waterlevel

    def _supply_ok(self) -> bool:
        """Enough data to keep a training cell busy: B ready groups, or ⌈σB⌉ (soon-)ready."""
        b = self.config.batch_groups
        if not self.policy.streaming:
            return len(self.ready) >= b
        need = max(1, math.ceil(self.config.supply_fraction * b))
        return len(self.ready) + self.soon_ready >= need

    def _remaining_microsteps(self, batch: Batch) -> float:
        per_group = (
            self.microsteps_packed / self.groups_packed
            if self.groups_packed
            else self.config.group_size
        )
        to_admit = min(self.config.batch_groups - batch.admitted, len(self.ready) + self.soon_ready)
        future = to_admit + batch.admitted - batch.packed
        return batch.queued - batch.claimed + per_group * future

    def _satellites(self) -> tuple[int, ...]:
        return tuple(c for unit in self.policy.units[1:] for c in unit)

    def _current(self, index: int, what: str) -> Batch:
        if self.batch is None or self.batch.index != index:
            raise SchedulerError(f"{what}: batch {index} is not the open batch")
        return self.batch
