"""The scheduler: one pure state machine for Elastic, Async and Colocate placement.

`Scheduler(config, policy).handle(event) -> list[Action]` is the whole interface. It keeps no
clock, does no I/O and starts no threads; the coordinator (over MPI) and the simulator (over
an event queue) feed it the same events and carry out the same actions. The equations it
implements are written down in docs/scheduler.md:

* counters d(t) >= p(t) >= f(t) >= 0 (dispatched, launched, terminated executions) and the
  waterlevel W = d - f (queued + running);
* groups of N + k executions (k: oversampling), ready once N settled valid or all settled;
  the surplus is cancelled or withdrawn (`gyre.schedule.groups`);
* boundary dispatch: (φ+μ)B groups at start, μB after each burst's publication;
* a switch unit leaves rollout when the remaining rollout capacity still serves every
  outstanding execution, C_R - C_u >= W, and (core) the supply check passes or (satellite)
  the open batch still has enough work for it to pay for its switches (cost-aware join, from
  the switch and pass seconds the driver measures, `gyre.schedule.costs`);
* streaming batches: ready groups are admitted oldest version first, cells claim micro-step
  passes (a prepass, then a gradient pass once its executions are summed), the join window
  closes before the single optimizer update;
* burst end: satellites return, the core publishes, then stays only if the next burst's
  supply check and C_R >= W hold.

Per event the work is proportional to what the event changed (a role, an engine, a claim),
never to the number of cells or executions: roles, capacities, the training prefix and the
idle training cells are kept incrementally.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gyre.errors import SchedulerError
from gyre.schedule.config import Config
from gyre.schedule.costs import CostEstimates, join_pays
from gyre.schedule.events import (
    Action,
    AdmitGroup,
    Assessed,
    BatchDone,
    Cancel,
    ClaimMicroStep,
    CloseJoinWindow,
    Dispatch,
    EngineLost,
    EngineRestored,
    Event,
    GradientsReady,
    GroupReady,
    Launch,
    Launched,
    MicroStepDone,
    MicroStepsQueued,
    OpenJoinWindow,
    OptimizerUpdate,
    Publish,
    Reroute,
    Start,
    SwitchCell,
    SwitchDone,
    Terminated,
    Tick,
    WeightsPublished,
    Withdraw,
    Work,
)
from gyre.schedule.groups import CLOSED, Groups
from gyre.schedule.policy import Policy
from gyre.schedule.routing import Engine, Engines
from gyre.vocabulary import Role

__all__ = ["Batch", "Engine", "Phase", "Scheduler"]

_TRAINING = (Role.TRAIN, Role.TO_TRAIN)


class Phase(enum.Enum):
    """Where the core is in the burst cycle."""

    IDLE = "idle"  # no burst: waiting for the supply check / waterlevel
    BURST = "burst"  # the core (unit 0) trains the burst's μ steps
    ENDING = "ending"  # last update done: satellites returning, then publication


@dataclass(slots=True)
class Batch:
    """The batch being trained: B groups streamed in as micro-steps, two passes each.

    `queued`/`claimed`/`done` count prepasses, `ready`/`grad_claimed`/`grad_done` gradient
    passes; every micro-step gets both, so the batch is complete when all B groups are
    packed and `grad_done == queued`.
    """

    index: int
    admitted: int = 0
    packed: int = 0
    queued: int = 0
    claimed: int = 0
    done: int = 0
    ready: int = 0
    grad_claimed: int = 0
    grad_done: int = 0
    window_open: bool = True
    updating: bool = False

    @property
    def complete(self) -> bool:
        """Every pass of every queued micro-step has finished."""
        return self.done == self.queued and self.grad_done == self.queued


class Scheduler:
    """Events in, actions out; see the module docstring and docs/scheduler.md."""

    def __init__(self, config: Config, policy: Policy) -> None:
        self.config = config
        self.policy = policy
        k = config.cells
        self.routing = Engines(k, config.standalone_engines, config.concurrency_per_cell,
                               config.engines_per_cell, config.engine_concurrency)  # fmt: skip
        self.engines = self.routing.engines
        self.route = self.routing.route  # running execution -> engine
        self.costs = CostEstimates(config)
        self.d = self.p = self.f = 0
        self.withdrawn = 0
        """Surplus executions withdrawn from the queue (counted in p and f, never launched)."""
        self.version = 0  # v: optimizer updates applied so far
        self.published = 0  # latest published version (recorded at dispatch)
        self.groups = Groups(config)
        self.queue: deque[int] = deque()
        self.ready: list[tuple[int, int]] = []  # heap of (v_d, group): oldest version first
        self.batch: Batch | None = None
        self.batches_opened = 0
        self.step_in_burst = 0
        self.phase = Phase.IDLE
        self.publishing = False
        self.started = False
        self.busy: list[Work | None] = [None] * k  # the pass each cell is computing
        self.claimed: list[int] = [0] * k  # how many micro-steps that pass holds (its window)
        self.window = config.window_for(1)
        """Micro-steps a pass claims at most. Whoever builds the config resolves auto for its
        cells' pipeline stages (`RunSchedule.scheduler`, `SimConfig.scheduler_for`); a
        config left at auto stands for cells of one stage."""
        self.microsteps_packed = 0
        self.groups_packed = 0
        self.wasted_switches = 0
        """Satellite switches to training that returned without claiming a single pass."""
        self._init_roles(k)
        self._handlers: dict[type, Callable[[Any, list[Action]], None]] = {
            Start: self._on_start,
            Launched: self._on_launched,
            Terminated: self._on_terminated,
            Assessed: self._on_assessed,
            GroupReady: self._on_group_ready,
            MicroStepsQueued: self._on_microsteps_queued,
            GradientsReady: self._on_gradients_ready,
            MicroStepDone: self._on_microstep_done,
            BatchDone: self._on_batch_done,
            SwitchDone: self._on_switch_done,
            WeightsPublished: self._on_weights_published,
            EngineLost: self._on_engine_lost,
            EngineRestored: self._on_engine_restored,
            Tick: lambda e, out: None,
        }

    def _init_roles(self, k: int) -> None:
        """Roles and the counters derived from them (kept in step by `_set_role`)."""
        units = self.policy.units
        self.roles = [Role.ROLLOUT] * k
        self._unit_of = {c: u for u, unit in enumerate(units) for c in unit}
        self._unit_rollout = [len(unit) for unit in units]  # cells of each unit in ROLLOUT
        self.satellites = tuple(c for unit in units[1:] for c in unit)
        self._is_satellite = [c in self.satellites for c in range(k)]
        self._away = 0  # satellites not in ROLLOUT
        self._training = 0  # cells in TRAIN or TO_TRAIN
        self._prefix = 0  # the longest prefix 0..m-1 of cells in TRAIN
        self._idle: set[int] = set()  # cells in TRAIN computing no pass
        self._idle_order: list[int] = []  # heap of them (and stale entries): lowest cell first
        self._worked = [True] * k  # satellite claimed a pass since it left rollout
        self._next_unit = 1  # the next unit to join the burst, in order
        for c in self.policy.fixed_train:
            self._set_role(c, Role.TRAIN)

    # ------------------------------------------------------------------ public state

    @property
    def waterlevel(self) -> int:
        """W(t) = d(t) - f(t): queued plus running executions."""
        return self.d - self.f

    @property
    def soon_ready(self) -> int:
        """R_soon: groups not ready that may become ready on outcomes alone (`Groups.soon`)."""
        return self.groups.soon_ready

    @property
    def rollout_capacity(self) -> int:
        """C_R: concurrency of the engines that accept executions now."""
        return self.routing.capacity

    def training_cells(self) -> tuple[int, ...]:
        return tuple(c for c, r in enumerate(self.roles) if r is Role.TRAIN)

    def update_cells(self) -> tuple[int, ...]:
        """The cells of an optimizer update: the longest prefix 0..m-1 that is in TRAIN.

        Units leave in order, but their switches may finish out of order (a cell whose
        engine drains slowly is still TO_TRAIN while a later one is in TRAIN); the
        reduction runs over a prebuilt prefix communicator, so a later cell waits out this
        update (it may claim prepasses meanwhile; gradient passes go to the prefix only).
        """
        return tuple(range(self._prefix))

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
        n = cfg.executions_per_group
        for v_d in event.carried:  # groups of a resumed job: closed and ready already
            g = self.groups.carry(v_d)
            self.d, self.p, self.f = self.d + n, self.p + n, self.f + n
            heapq.heappush(self.ready, (v_d, g))
        depth = cfg.extra_groups + cfg.mu * cfg.batch_groups
        self._dispatch(max(0, depth - len(event.carried)), out)

    def _on_launched(self, event: Launched, out: list[Action]) -> None:
        if event.execution not in self.route:
            raise SchedulerError(f"Launched: execution {event.execution} is not running")

    def _on_terminated(self, event: Terminated, out: list[Action]) -> None:
        x = event.execution
        if self.routing.remove(x) is None:
            raise SchedulerError(f"Terminated: execution {x} is not running (f counts once)")
        self.f += 1
        self.groups.terminate(x)

    def _on_assessed(self, event: Assessed, out: list[Action]) -> None:
        """An outcome settled; a group it completes is ready, and its surplus is stopped."""
        groups = self.groups
        if not groups.assess(event.execution, event.valid):
            return
        g = groups.group_of(event.execution)
        heapq.heappush(self.ready, (groups[g].version, g))
        running, queued = groups.surplus(g)
        out.extend(Cancel(x) for x in running)  # they stay on their engines until Terminated
        if queued:
            drop = set(queued)
            self.queue = deque(x for x in self.queue if x not in drop)
            self.p, self.f, self.withdrawn = (self.p + len(queued), self.f + len(queued),
                                              self.withdrawn + len(queued))  # fmt: skip
            out.extend(Withdraw(x) for x in queued)

    def _on_group_ready(self, event: GroupReady, out: list[Action]) -> None:
        groups, g = self.groups, event.group
        if not 0 <= g < len(groups) or groups[g].closed < groups.size:
            raise SchedulerError(f"GroupReady: group {g} still has running executions")
        if groups[g].complete:
            raise SchedulerError(f"GroupReady: group {g} is ready already")
        for x in groups.executions(g):
            if groups.state[x] == CLOSED:
                self._on_assessed(Assessed(x, valid=True), out)

    def _on_microsteps_queued(self, event: MicroStepsQueued, out: list[Action]) -> None:
        batch = self._current(event.batch, "MicroStepsQueued")
        if batch.packed >= batch.admitted or event.count < 0:
            raise SchedulerError(f"MicroStepsQueued: unexpected {event!r}")
        batch.packed += 1
        batch.queued += event.count
        self.groups_packed += 1
        self.microsteps_packed += event.count

    def _on_gradients_ready(self, event: GradientsReady, out: list[Action]) -> None:
        batch = self._current(event.batch, "GradientsReady")
        if event.count < 0 or batch.ready + event.count > batch.done:
            raise SchedulerError(f"GradientsReady: {event!r} exceeds the finished prepasses")
        batch.ready += event.count

    def _on_microstep_done(self, event: MicroStepDone, out: list[Action]) -> None:
        batch = self._current(event.batch, "MicroStepDone")
        c = event.cell
        work = self.busy[c] if 0 <= c < len(self.busy) else None
        if work is None:
            raise SchedulerError(f"MicroStepDone: cell {c} claimed nothing")
        count = self.claimed[c]
        seconds = None if event.seconds is None else event.seconds / count  # per micro-step
        self.costs.passed(work, seconds)
        self.busy[c] = None
        if self.roles[c] is Role.TRAIN:
            self._make_idle(c)
        if work is Work.PREPASS:
            batch.done += count
        else:
            batch.grad_done += count

    def _on_batch_done(self, event: BatchDone, out: list[Action]) -> None:
        batch = self._current(event.batch, "BatchDone")
        if not batch.updating:
            raise SchedulerError(f"BatchDone: batch {batch.index} has no update running")
        self.batch = None
        self.version += 1
        self.step_in_burst += 1
        if self.step_in_burst == self.config.mu:
            self.phase = Phase.ENDING
            for c in self.satellites:
                if self.roles[c] is Role.TRAIN:
                    self._switch_cell(c, Role.ROLLOUT, out)

    def _on_switch_done(self, event: SwitchDone, out: list[Action]) -> None:
        c = event.cell
        role = self.roles[c] if 0 <= c < len(self.roles) else None
        if role is Role.TO_TRAIN:
            self.costs.switched(c, Role.TRAIN, event.seconds)
            self._set_role(c, Role.TRAIN)
            late = self._is_satellite[c] and self.phase is not Phase.BURST
            if late or (self.policy.switches and self.phase is Phase.IDLE):
                self._switch_cell(c, Role.ROLLOUT, out)  # the burst it switched for is over
        elif role is Role.TO_ROLLOUT:
            self.costs.switched(c, Role.ROLLOUT, event.seconds)
            self._set_role(c, Role.ROLLOUT)
        else:
            what = role.value if role is not None else "no such cell"
            raise SchedulerError(f"SwitchDone: cell {c} is not switching ({what})")

    def _on_engine_lost(self, event: EngineLost, out: list[Action]) -> None:
        """A dead engine is no destination; its executions move where there is room."""
        self._engine(event.engine, "EngineLost")
        for x, dest in self.routing.set_up(event.engine, False):
            out.append(Reroute(execution=x, source=event.engine, destination=dest))

    def _on_engine_restored(self, event: EngineRestored, out: list[Action]) -> None:
        self._engine(event.engine, "EngineRestored")
        self.routing.set_up(event.engine, True)

    def _engine(self, index: int, what: str) -> None:
        if not 0 <= index < len(self.engines):
            raise SchedulerError(
                f"{what}: no engine {index}; engines are 0..{len(self.engines) - 1}"
            )

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
                self._begin_burst()  # core retention
            else:  # cells still arriving (TO_TRAIN) turn back on their SwitchDone
                for c in self.policy.units[0]:
                    if self.roles[c] is Role.TRAIN:
                        self._switch_cell(c, Role.ROLLOUT, out)

    # ------------------------------------------------------------------ decisions

    def _advance(self, out: list[Action]) -> None:
        """Every decision the new state may allow; each step returns at once when its
        precondition is unchanged (the guards here keep a quiet event cheap)."""
        if self.queue:
            self._launch(out)
        if self.phase is Phase.IDLE:
            self._maybe_start_burst(out)
        if self.phase is Phase.BURST:
            if self.batch is None:
                self._maybe_open_batch(out)
            batch = self.batch
            if batch is not None:
                if self.ready and batch.admitted < self.config.batch_groups:
                    self._admit(out)
                if batch.window_open and self._next_unit < len(self.policy.units):
                    self._maybe_join(out)
                if self._idle:
                    self._claim(out)
                if batch.packed == self.config.batch_groups and batch.claimed == batch.queued:
                    self._maybe_update(out)
        if self.phase is Phase.ENDING:
            self._maybe_publish(out)
        if self.queue:
            self._launch(out)

    def _begin_burst(self) -> None:
        self.phase = Phase.BURST
        self._next_unit = 1

    def _maybe_start_burst(self, out: list[Action]) -> None:
        if not self._supply_ok():
            return
        if not self.policy.switches:
            self._begin_burst()
            return
        unit = self.policy.units[0]
        if self._unit_rollout[0] == len(unit) and self._waterlevel_ok(0):
            for c in unit:
                self._switch_cell(c, Role.TRAIN, out)
            self._begin_burst()

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
            members = self.groups[g].members or ()
            out.append(AdmitGroup(group=g, batch=batch.index, staleness=self.version - v_d,
                                  members=members))  # fmt: skip

    def _maybe_join(self, out: list[Action]) -> None:
        """Satellite units leave rollout in order while Eq. 6 holds and the join pays."""
        batch = self.batch
        if batch is None or not batch.window_open:
            return
        units = self.policy.units
        while self._next_unit < len(units):
            u = self._next_unit
            if self._unit_rollout[u] != len(units[u]):
                return  # still returning from an earlier burst: keep the cell order
            if not self._waterlevel_ok(u) or not self._join_pays(units[u], batch):
                return
            for c in units[u]:
                self._switch_cell(c, Role.TRAIN, out)
            self._next_unit += 1

    def _join_pays(self, unit: tuple[int, ...], batch: Batch) -> bool:
        """Enough passes left (`join_min_microsteps`) and, in measured seconds, a micro-step
        left to start and enough work to cover the unit's switches (`costs.join_pays`)."""
        if batch.packed < batch.admitted or not self.groups_packed:
            return False  # decide on counted micro-steps: every admitted group's, and m̄
        prepasses, gradients = self._passes_left(batch)
        cfg = self.config
        if prepasses + gradients < cfg.join_min_microsteps:
            return False
        if cfg.join_payback == 0:
            return True
        costs = self.costs
        t_pre, t_grad = costs.pass_s(Work.PREPASS), costs.pass_s(Work.GRADIENT)
        return join_pays(
            work_s=prepasses * t_pre + gradients * t_grad,
            microsteps=prepasses,
            trainers=self._training,
            joining=len(unit),
            switch_in_s=max(costs.switch_s(c, Role.TRAIN) for c in unit),
            switch_out_s=max(costs.switch_s(c, Role.ROLLOUT) for c in unit),
            chain_s=t_pre + t_grad,
            payback=cfg.join_payback,
        )

    def _claim(self, out: list[Action]) -> None:
        """Idle training cells claim a pass, in cell order: ready gradients if they are in
        the training prefix (prefix cells prefer them: they are most of the work), else
        prepasses; each pass a window of what is queued, at most `window` micro-steps (one
        queued later joins a later window)."""
        batch = self.batch
        if batch is None or not self._idle:
            return
        gradients = batch.ready - batch.grad_claimed
        prepasses = batch.queued - batch.claimed
        if gradients <= 0 and prepasses <= 0:
            return
        heap, idle = self._idle_order, self._idle
        while heap and (gradients > 0 or prepasses > 0):
            c = heap[0]
            if c not in idle:  # it left TRAIN, or claimed, since it was pushed
                heapq.heappop(heap)
                continue
            window = self.window
            if c < self._prefix and gradients > 0:
                work, count = Work.GRADIENT, min(window, gradients)
                gradients -= count
                batch.grad_claimed += count
            elif prepasses > 0:
                work, count = Work.PREPASS, min(window, prepasses)
                prepasses -= count
                batch.claimed += count
            else:
                return  # only gradient passes left, and every idle cell is past the prefix
            heapq.heappop(heap)
            idle.discard(c)
            self.busy[c], self.claimed[c] = work, count
            self._worked[c] = True
            out.append(ClaimMicroStep(cell=c, batch=batch.index, work=work, count=count))

    def _maybe_update(self, out: list[Action]) -> None:
        batch = self.batch
        b = self.config.batch_groups
        if batch is None or batch.packed < b or batch.claimed < batch.queued:
            return
        if batch.done == batch.queued and batch.grad_claimed == batch.queued and batch.window_open:
            batch.window_open = False  # every pass is claimed: nothing left to join for
            out.append(CloseJoinWindow(batch.index))
        if batch.complete and not batch.updating:  # (the window closed just above)
            batch.updating = True
            out.append(OptimizerUpdate(batch=batch.index, cells=self.update_cells()))

    def _maybe_publish(self, out: list[Action]) -> None:
        if self.publishing or self._away:
            return
        self.publishing = True
        engines = tuple(e.index for e in self.engines if e.open)
        out.append(Publish(version=self.version, engines=engines))

    # ------------------------------------------------------------------ mechanics

    def _dispatch(self, groups: int, out: list[Action]) -> None:
        for _ in range(groups):
            g = len(self.groups)
            executions = self.groups.dispatch(self.published)
            self.queue.extend(executions)
            self.d += len(executions)
            out.append(Dispatch(group=g, executions=executions, version=self.published))

    def _launch(self, out: list[Action]) -> None:
        queue = self.queue
        while queue:
            engine = self.routing.place(queue[0])
            if engine is None:
                return
            x = queue.popleft()
            self.p += 1
            self.groups.launch(x)
            out.append(Launch(execution=x, engine=engine))

    def _switch_cell(self, c: int, role: Role, out: list[Action]) -> None:
        if role is Role.TRAIN:
            self._set_role(c, Role.TO_TRAIN)
            self._worked[c] = not self._is_satellite[c]
            out.append(SwitchCell(cell=c, role=Role.TRAIN))
            # §4.3: the source stopped accepting; destinations are reserved, calls retried
            for x, source, dest in self.routing.reroute(c):
                out.append(Reroute(execution=x, source=source, destination=dest))
        else:
            if not self._worked[c]:
                self.wasted_switches += 1  # it left rollout and trained nothing
            self._set_role(c, Role.TO_ROLLOUT)
            out.append(SwitchCell(cell=c, role=Role.ROLLOUT))

    def _set_role(self, c: int, role: Role) -> None:
        """Change a cell's role and every counter derived from roles."""
        old = self.roles[c]
        self.roles[c] = role
        u = self._unit_of.get(c)
        if u is not None:
            self._unit_rollout[u] += (role is Role.ROLLOUT) - (old is Role.ROLLOUT)
        if self._is_satellite[c]:
            self._away += (old is Role.ROLLOUT) - (role is Role.ROLLOUT)
        self._training += (role in _TRAINING) - (old in _TRAINING)
        self.routing.set_accepting(c, role is Role.ROLLOUT)
        if role is Role.TRAIN:
            if self.busy[c] is None:
                self._make_idle(c)
            while self._prefix < len(self.roles) and self.roles[self._prefix] is Role.TRAIN:
                self._prefix += 1
        else:
            self._idle.discard(c)
            if old is Role.TRAIN and c < self._prefix:
                self._prefix = c

    def _make_idle(self, c: int) -> None:
        if c not in self._idle:
            self._idle.add(c)
            heapq.heappush(self._idle_order, c)

    # ------------------------------------------------------------------ checks

    def _waterlevel_ok(self, u: int) -> bool:
        """C_R - C_u >= W: the engines left in rollout still serve every outstanding execution."""
        leaving = self._unit_rollout[u] * self.config.concurrency_per_cell
        return self.routing.capacity - leaving >= self.waterlevel

    def _supply_ok(self) -> bool:
        """May a burst start: with streaming ⌈σB⌉ groups ready or soon ready (training
        streams the rest in); without, every group of the burst's remaining steps ready, as
        a baseline's burst trains its μ steps back to back on completed groups."""
        b = self.config.batch_groups
        if not self.policy.streaming:
            return len(self.ready) >= b * (self.config.mu - self.step_in_burst)
        need = max(1, math.ceil(self.config.supply_fraction * b))
        return len(self.ready) + self.soon_ready >= need

    def _passes_left(self, batch: Batch) -> tuple[float, float]:
        """(prepasses, gradient passes) a joining cell could still claim: those of the queued
        micro-steps not claimed yet, and both of the groups still to be packed (m̄ each, the
        mean so far; a join waits for the run's first packed group)."""
        per_group = self.microsteps_packed / max(1, self.groups_packed)
        to_admit = min(self.config.batch_groups - batch.admitted, len(self.ready) + self.soon_ready)
        future = per_group * (to_admit + batch.admitted - batch.packed)
        return batch.queued - batch.claimed + future, batch.queued - batch.grad_claimed + future

    def _current(self, index: int, what: str) -> Batch:
        if self.batch is None or self.batch.index != index:
            raise SchedulerError(f"{what}: batch {index} is not the open batch")
        return self.batch
