"""Discrete-event simulator: an event queue and a workload model around the real scheduler.

The simulator owns time; `gyre.schedule.Scheduler` owns every decision. Each scheduler action
is carried out with a duration from the workload/cost model and answered with the event the
coordinator would send (Launch -> Terminated -> Assessed, Cancel -> Terminated, SwitchCell ->
SwitchDone, ClaimMicroStep -> MicroStepDone, ...), with the same measured seconds the runtime
reports, so the scheduler's cost-aware joins see the true costs. Under oversampling
(`scheduler.oversample` k) each group runs N + k executions and trains the N members the
scheduler names; a cancelled surplus execution frees its slot at once. Usage:

    result = Simulator(load_sim_config("templates/sim/nl2repo.yaml"), "elastic").run()
    print(result.total_h, result.mean_staleness)

Training work comes from each execution's tokens, sampled at dispatch (or recorded, in a
replay), never from how long it happened to run: a harness timeout trains on the share of its
work done by then.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gyre.errors import SchedulerError
from gyre.schedule import events as ev
from gyre.schedule.devices import EngineModel, EnginePool
from gyre.schedule.feed import Feed
from gyre.schedule.machine import Scheduler
from gyre.schedule.plan import expected_staleness
from gyre.schedule.policy import make_policy
from gyre.sim.config import SimConfig
from gyre.sim.report import SimResult
from gyre.sim.workload import HOUR, EmpiricalWorkload, GroupSample, Workload
from gyre.vocabulary import Outcome, Role

INF = float("inf")
# kinds of timed events on the queue
ENGINE, TIMEOUT, EVALUATED, SWITCH, MICRO, UPDATE, PUBLISH = range(7)


class Simulator:
    """Runs one policy of a `SimConfig` for `steps` training steps.

    `groups`, when given, replaces the synthetic workload by recorded groups drawn with
    replacement, or in their order with `in_order` (`gyre sim --replay [--in-order]`).
    """

    def __init__(
        self,
        config: SimConfig,
        policy: str,
        steps: int | None = None,
        seed: int | None = None,
        groups: list[GroupSample] | None = None,
        in_order: bool = False,
    ) -> None:
        self.config = config
        self.sched_config, policy_config = config.scheduler_for(policy)
        self.policy = make_policy(self.sched_config, policy_config)
        self.scheduler = Scheduler(self.sched_config, self.policy)
        self.steps = steps if steps is not None else config.steps
        self.seed = seed if seed is not None else config.seed
        sc, wl = self.sched_config, config.workload
        self.workload: Workload | EmpiricalWorkload = (
            EmpiricalWorkload(groups, self.seed, in_order)
            if groups is not None
            else Workload(wl, sc.executions_per_group, self.seed)
        )
        model = EngineModel.for_size(sc.nodes_per_cell, sc.concurrency_per_cell,
                                     wl.generation_share, wl.saturation_half_per_node)  # fmt: skip
        engines = sc.engines  # a cell's engines share its nodes; standalone ones are cell-sized
        share = EngineModel.for_size(sc.nodes_per_cell / sc.engines_per_cell, sc.engine_concurrency,
                                     wl.generation_share, wl.saturation_half_per_node)  # fmt: skip
        cells = sc.cells * sc.engines_per_cell
        self.pool = EnginePool(engines, model, [share] * cells if sc.engines_per_cell > 1 else ())
        self.armed_at = [INF] * engines  # time of each engine's armed completion timer
        self.armed_id = [0] * engines
        self.nodes_per_cell = sc.nodes_per_cell
        self.timeout_s = wl.harness_timeout_h * HOUR
        self.now = 0.0
        self.queue: list[tuple[float, int, int, int, int]] = []
        self.seq = 0  # tie-breaker: equal times keep their scheduling order
        # an event to the scheduler, its actions carried out (an event an action raises,
        # AdmitGroup -> MicroStepsQueued, waits until the current one is done); bound
        # `__call__`: the hot path skips the instance-call lookup (measured: 1-2 % of a run)
        self.feed = Feed(self.scheduler, _ACTIONS, self).__call__
        # per execution (index = execution id)
        self.nominal: list[float] = []
        self.full_tokens: list[float] = []
        self.tokens: list[float] = []  # admitted training tokens (0 until it ended)
        self.eval_s: list[float] = []
        self.launch_t: list[float] = []
        self.end_t: list[float] = []
        self.valid: list[bool] = []
        self.outcome: list[Outcome | None] = []  # None until it ended
        self.done: list[float] = []  # share of its work done when it ended
        self.withdrawn: set[int] = set()  # surplus executions that never launched
        self.groups = 0
        self.batch_tokens: dict[int, deque[float]] = {}  # micro-steps awaiting their prepass
        self.batch_gradients: dict[int, deque[float]] = {}  # ... awaiting their gradient pass
        self.packing: dict[int, list[float]] = {}  # batch -> [groups admitted, tokens held]
        self.prepassing: dict[int, list[float]] = {}  # cell -> tokens of the prepasses it runs
        self.running: dict[int, float] = {}  # cell -> seconds of the pass it computes
        self.recomputed: dict[int, float] = {}  # execution -> reroute penalties, seconds
        # records
        self.step_end: list[float] = []
        self.staleness: list[int] = []
        self.batch_groups: dict[int, list[int]] = {}
        self.members: dict[int, tuple[int, ...]] = {}  # admitted group -> the N that train
        self.timeline: list[tuple[float, int, str]] = []
        self.reroutes = 0
        self.windows: list[tuple[float, int, str]] = []

    # ------------------------------------------------------------------ main loop

    def run(self) -> SimResult:
        """Simulate until `steps` optimizer updates completed; returns the summary."""
        started = time.perf_counter()
        for c in range(self.sched_config.cells):
            self.timeline.append((0.0, c, self.scheduler.roles[c].value))
        self.now = self.config.costs.startup_s
        self.feed(ev.Start())
        queue, on_timer = self.queue, self._on_timer
        while len(self.step_end) < self.steps:
            if not queue:
                raise SchedulerError(
                    f"simulation stalled after {len(self.step_end)} steps "
                    f"(waterlevel {self.scheduler.waterlevel}, phase {self.scheduler.phase.value})"
                )
            t, _, kind, a, b = heapq.heappop(queue)
            self.now = t
            on_timer(kind, a, b)
        return summarize(self, time.perf_counter() - started)

    def _at(self, delay: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (self.now + delay, self.seq, kind, a, b))

    # ------------------------------------------------------------------ timers

    def _on_timer(self, kind: int, a: int, b: int) -> None:
        if kind == ENGINE:
            if b == self.armed_id[a]:
                self.armed_at[a] = INF
                self._engine_due(a)
        elif kind == MICRO:
            self._micro_done(a, b)
        elif kind == EVALUATED:
            self.feed(ev.Assessed(a, self.valid[a]))
        elif kind == TIMEOUT:
            if self.pool.engine_of(a) is not None:
                self._terminate(a, Outcome.TIMED_OUT)
        elif kind == SWITCH:
            # the role it arrives in, recorded before the scheduler reacts: a satellite whose
            # burst ended while it switched is sent straight back (a second entry, to_rollout)
            arrived = Role.TRAIN if b else Role.ROLLOUT
            self.timeline.append((self.now, a, arrived.value))
            self.feed(ev.SwitchDone(a, seconds=self._switch_s(b)))
        elif kind == UPDATE:
            self.step_end.append(self.now)
            self.feed(ev.BatchDone(a))
        elif kind == PUBLISH:
            self.feed(ev.WeightsPublished(a))

    def _engine_due(self, e: int) -> None:
        nxt = self.pool.next_completion(e)
        if nxt is None:
            return
        when, x = nxt
        if when > self.now + 1e-6:  # the engine slowed down since the timer was armed
            self._retime(e)
            return
        self._terminate(x, Outcome.COMPLETED)

    def _retime(self, e: int) -> None:
        """Arm the engine's timer for its next completion, unless one is armed earlier (a
        timer that fires early re-arms; only a completion that moved earlier needs a new
        one, so a launch, which slows the engine down, costs no timer)."""
        nxt = self.pool.next_completion(e)
        if nxt is not None and nxt[0] < self.armed_at[e] - 1e-6:
            self.armed_at[e] = nxt[0]
            self._at(max(0.0, nxt[0] - self.now), ENGINE, e, self.seq + 1)
            self.armed_id[e] = self.seq

    def _terminate(self, x: int, outcome: Outcome) -> None:
        e = self.pool.where[x]
        left = self.pool.remove(x, self.now)
        self._retime(e)
        self.end_t[x] = self.now
        self.outcome[x] = outcome
        work = self.nominal[x] + self.recomputed.get(x, 0.0)
        done = 1.0 - left / work if work > 0 else 1.0
        self.done[x] = min(1.0, max(0.0, done))
        self.tokens[x] = self.full_tokens[x] * self.done[x]
        deadline = self.launch_t[x] + self.config.workload.overall_timeout_h * HOUR
        scored = self.now + self.eval_s[x]
        self.valid[x] = scored <= deadline  # else excluded: settled when its budget ends
        self._at(min(scored, deadline) - self.now, EVALUATED, x)
        self.feed(ev.Terminated(x, outcome))

    # ------------------------------------------------------------------ actions

    def _dispatch(self, a: ev.Dispatch) -> None:
        sample = self.workload.sample_group()
        self.nominal.extend(sample.nominal_s.tolist())
        self.full_tokens.extend(sample.tokens.tolist())
        self.eval_s.extend(sample.eval_s.tolist())
        n = len(a.executions)
        self.tokens.extend([0.0] * n)
        self.launch_t.extend([-1.0] * n)
        self.end_t.extend([-1.0] * n)
        self.valid.extend([False] * n)
        self.outcome.extend([None] * n)
        self.done.extend([0.0] * n)
        self.groups += 1

    def _launch(self, a: ev.Launch) -> None:
        x = a.execution
        self.launch_t[x] = self.now
        self.pool.add(x, a.engine, self.nominal[x], self.now)
        self._retime(a.engine)
        if self.nominal[x] > self.timeout_s:  # rate >= 1 at loads <= the limit: others end first
            self._at(self.timeout_s, TIMEOUT, x)

    def _cancel(self, a: ev.Cancel) -> None:
        """A surplus execution stops now (its slot is free); its outcome still settles."""
        if self.pool.engine_of(a.execution) is not None:
            self._terminate(a.execution, Outcome.CANCELLED)

    def _withdraw(self, a: ev.Withdraw) -> None:
        self.withdrawn.add(a.execution)

    def _reroute(self, a: ev.Reroute) -> None:
        self.reroutes += 1
        if self.pool.engine_of(a.execution) is None:
            return  # a surplus execution cancelled by an earlier action of the same event
        remaining = self.pool.remove(a.execution, self.now)
        penalty = self.config.costs.reroute_penalty_s
        x = a.execution
        self.pool.add(x, a.destination, remaining + penalty, self.now)
        self.recomputed[x] = self.recomputed.get(x, 0.0) + penalty  # work, not progress
        if self.nominal[x] <= self.timeout_s < self.now - self.launch_t[x] + remaining + penalty:
            self._at(self.launch_t[x] + self.timeout_s - self.now, TIMEOUT, x)  # now it may
        self._retime(a.source)
        self._retime(a.destination)

    def _switch(self, a: ev.SwitchCell) -> None:
        self.timeline.append((self.now, a.cell, self.scheduler.roles[a.cell].value))
        to_train = int(a.role is Role.TRAIN)
        self._at(self._switch_s(to_train), SWITCH, a.cell, to_train)

    def _switch_s(self, to_train: int) -> float:
        return self.config.costs.switch_s(bool(to_train))

    def _admit(self, a: ev.AdmitGroup) -> None:
        self.staleness.append(a.staleness)
        self.batch_groups.setdefault(a.batch, []).append(a.group)
        self.members[a.group] = a.members
        tokens = [self.tokens[x] for x in a.members if self.valid[x]]
        steps = self._pack(a.batch, tokens)
        self.batch_tokens.setdefault(a.batch, deque()).extend(steps)
        self.feed(ev.MicroStepsQueued(batch=a.batch, group=a.group, count=len(steps)))

    def _pack(self, batch: int, tokens: list[float]) -> list[float]:
        """Micro-steps (their tokens) the packing buffer emits for one more group: one per
        execution, or `microstep_tokens` each with the partial last one held until the
        batch's B-th group (as the runtime's stream packing buffer does)."""
        size = self.config.costs.microstep_tokens
        if size <= 0:
            return tokens
        state = self.packing.setdefault(batch, [0.0, 0.0])
        state[0] += 1
        state[1] += sum(tokens)
        steps = []
        while state[1] >= size:
            steps.append(size)
            state[1] -= size
        if state[0] == self.sched_config.batch_groups and state[1] > 0:
            steps.append(state[1])
            state[1] = 0.0
        return steps

    def _claim(self, a: ev.ClaimMicroStep) -> None:
        """A window of `count` micro-steps, 1F1B through the cell's pipeline stages
        (`CostConfig.window_s`, the paced runtime's charge): a prepass costs one forward
        (`prepass_ratio` of forward + backward), a gradient pass a forward + backward, both of
        the micro-steps' tokens (docs/training.md)."""
        prepass = a.work is ev.Work.PREPASS
        queue = self.batch_tokens[a.batch] if prepass else self.batch_gradients[a.batch]
        tokens = [queue.popleft() for _ in range(a.count)]
        if prepass:
            self.prepassing[a.cell] = tokens
        duration = self.config.costs.window_s(tokens, self.nodes_per_cell, prepass=prepass)
        self.running[a.cell] = duration
        self._at(duration, MICRO, a.cell, a.batch)

    def _micro_done(self, cell: int, batch: int) -> None:
        """A simulated micro-step's rows belong to its own executions, so its gradient is
        ready right after its own prepass."""
        tokens = self.prepassing.pop(cell, None)
        self.feed(ev.MicroStepDone(cell=cell, batch=batch, seconds=self.running.pop(cell)))
        if tokens is not None:
            self.batch_gradients.setdefault(batch, deque()).extend(tokens)
            self.feed(ev.GradientsReady(batch=batch, count=len(tokens)))

    def _update(self, a: ev.OptimizerUpdate) -> None:
        self.batch_tokens.pop(a.batch, None)
        self.batch_gradients.pop(a.batch, None)
        self.packing.pop(a.batch, None)
        self._at(self.config.costs.update_s, UPDATE, a.batch)

    def _publish(self, a: ev.Publish) -> None:
        self._at(self.config.costs.publish_s, PUBLISH, a.version)

    def _window(self, a: ev.OpenJoinWindow | ev.CloseJoinWindow) -> None:
        kind = "open" if isinstance(a, ev.OpenJoinWindow) else "close"
        self.windows.append((self.now, a.batch, kind))


_ACTIONS: dict[type, Callable[[Simulator, Any], None]] = {
    ev.Dispatch: Simulator._dispatch,
    ev.Launch: Simulator._launch,
    ev.Cancel: Simulator._cancel,
    ev.Withdraw: Simulator._withdraw,
    ev.Reroute: Simulator._reroute,
    ev.SwitchCell: Simulator._switch,
    ev.AdmitGroup: Simulator._admit,
    ev.ClaimMicroStep: Simulator._claim,
    ev.OptimizerUpdate: Simulator._update,
    ev.Publish: Simulator._publish,
    ev.OpenJoinWindow: Simulator._window,
    ev.CloseJoinWindow: Simulator._window,
}


# ------------------------------------------------------------------ summary


def summarize(sim: Simulator, wall_s: float) -> SimResult:
    """What the finished run `sim` measured, from its records."""
    total = sim.step_end[sim.steps - 1]
    sc = sim.sched_config
    consumed = [g for b in range(sim.steps) for g in sim.batch_groups.get(b, [])]
    return SimResult(
        policy=sim.policy.name,
        phi=sc.phi,
        mu=sc.mu,
        steps=sim.steps,
        total_h=total / HOUR,
        step_end_h=[t / HOUR for t in sim.step_end[: sim.steps]],
        mean_staleness=statistics.fmean(sim.staleness) if sim.staleness else 0.0,
        expected_staleness=expected_staleness(sc.extra_groups / sc.batch_groups, sc.mu),
        ideal_h=_ideal_s(sim, consumed) / HOUR,
        utilization=_ideal_s(sim, consumed) / total if total else 0.0,
        train_share=_train_share(sim.timeline, sc.cells, total),
        executions=sum(1 for t in sim.launch_t if t >= 0),
        cancelled=sum(1 for o in sim.outcome if o is Outcome.CANCELLED),
        withdrawn=len(sim.withdrawn),
        reroutes=sim.reroutes,
        switches=sum(1 for _, _, role in sim.timeline if role in ("to_train", "to_rollout")),
        wasted_switches=sim.scheduler.wasted_switches,
        workload=_workload_stats(sim),
        wall_s=wall_s,
        timeline=list(sim.timeline),
    )


def _ideal_s(sim: Simulator, groups: list[int]) -> float:
    """Perfect overlap at the same budget: (rollout + training node-seconds) / nodes.

    Rollout counts the work of each consumed group's executions at the reference load (every
    engine full; a cancelled surplus execution the share it did, a withdrawn one none),
    training its members' tokens' gradient pass and prepass at the node throughput."""
    sc, costs = sim.sched_config, sim.config.costs
    n = sc.executions_per_group
    slot_s = tokens = 0.0
    for g in groups:
        for x in range(g * n, (g + 1) * n):
            if x in sim.withdrawn:
                continue
            share = sim.done[x] if sim.outcome[x] is Outcome.CANCELLED else 1.0
            slot_s += min(sim.nominal[x], sim.timeout_s) * share
        for x in sim.members[g]:
            if sim.valid[x]:
                tokens += sim.tokens[x]
    rollout_node_s = slot_s * sc.nodes_per_cell / sc.concurrency_per_cell
    train_node_s = tokens * (1 + costs.prepass_ratio) / costs.train_tokens_per_node_s
    return (rollout_node_s + train_node_s) / (sc.nodes + sc.standalone_nodes)


def _train_share(timeline: list[tuple[float, int, str]], cells: int, end: float) -> list[float]:
    """Per cell, the share of [0, end] spent outside ROLLOUT (training or switching)."""
    spent = [0.0] * cells
    last: list[tuple[float, str]] = [(0.0, Role.ROLLOUT.value)] * cells
    for t, c, role in sorted(timeline, key=lambda r: r[0]):
        t = min(t, end)
        since, prev = last[c]
        if prev != Role.ROLLOUT.value:
            spent[c] += t - since
        last[c] = (t, role)
    for c, (since, prev) in enumerate(last):
        if prev != Role.ROLLOUT.value:
            spent[c] += end - since
    return [s / end if end else 0.0 for s in spent]


def _workload_stats(sim: Simulator) -> dict[str, float]:
    n = sim.sched_config.executions_per_group
    ended = [x for x, t in enumerate(sim.end_t) if t >= 0]
    if not ended:
        return {}
    runs = [sim.end_t[x] - sim.launch_t[x] for x in ended]
    spans = []
    for g in range(sim.groups):
        xs = [x for x in range(g * n, (g + 1) * n) if x not in sim.withdrawn]
        if all(sim.end_t[x] >= 0 for x in xs):
            spans.append(max(sim.end_t[x] for x in xs) - min(sim.launch_t[x] for x in xs))
    return {
        "mean_execution_h": statistics.fmean(runs) / HOUR,
        "mean_query_h": statistics.fmean(spans) / HOUR if spans else 0.0,
        "queries_over_4h": sum(s >= 4 * HOUR - 1 for s in spans) / len(spans) if spans else 0.0,
        "harness_timeouts": sum(sim.outcome[x] is Outcome.TIMED_OUT for x in ended) / len(ended),
        "overall_timeouts": sum(not sim.valid[x] for x in ended) / len(ended),
    }
