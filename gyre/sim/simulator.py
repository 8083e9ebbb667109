"""Discrete-event simulator: an event queue and a workload model around the real scheduler.

The simulator owns time; `gyre.schedule.Scheduler` owns every decision. Each scheduler action
is carried out with a duration from the workload/cost model and answered with the event the
coordinator would send (Launch -> Terminated, SwitchCell -> SwitchDone, ClaimMicroStep ->
MicroStepDone, ...). Usage:

    result = Simulator(load_sim_config("templates/sim/nl2repo.yaml"), "elastic").run()
    print(result.total_h, result.mean_staleness)
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gyre.errors import SchedulerError
from gyre.schedule import events as ev
from gyre.schedule.machine import Scheduler
from gyre.schedule.policy import make_policy
from gyre.sim.config import SimConfig
from gyre.sim.engines import EnginePool
from gyre.sim.report import SimResult, summarize
from gyre.sim.workload import HOUR, Workload

# kinds of timed events on the queue
ENGINE, TIMEOUT, EVALUATED, SWITCH, MICRO, UPDATE, PUBLISH = range(7)


class Simulator:
    """Runs one policy of a `SimConfig` for `steps` training steps."""

    def __init__(
        self, config: SimConfig, policy: str, steps: int | None = None, seed: int | None = None
    ) -> None:
        self.config = config
        self.sched_config, policy_config = config.scheduler_for(policy)
        self.policy = make_policy(self.sched_config, policy_config)
        self.scheduler = Scheduler(self.sched_config, self.policy)
        self.steps = steps if steps is not None else config.steps
        self.seed = seed if seed is not None else config.seed
        n = self.sched_config.group_size
        self.workload = Workload(config.workload, n, self.seed)
        sc, wl = self.sched_config, config.workload
        self.pool = EnginePool(
            sc.cells + sc.standalone_engines,
            sc.concurrency_per_cell,
            wl.generation_share,
            wl.saturation_half,
        )
        self.cell_tokens_s = sc.nodes_per_cell * config.costs.train_tokens_per_node_s
        self.now = 0.0
        self.queue: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()
        self.pending: deque[ev.Event] = deque()
        # per execution (index = execution id)
        self.nominal: list[float] = []
        self.eval_s: list[float] = []
        self.launch_t: list[float] = []
        self.end_t: list[float] = []
        self.valid: list[bool] = []
        self.outcome: list[str] = []
        self.evaluated: list[int] = []  # per group
        self.batch_tokens: dict[int, deque[float]] = {}
        self.filled: set[tuple[int, int]] = set()
        # records
        self.step_end: list[float] = []
        self.staleness: list[int] = []
        self.batch_groups: dict[int, list[int]] = {}
        self.timeline: list[tuple[float, int, str]] = []
        self.reroutes = 0
        self.windows: list[tuple[float, int, str]] = []

    # ------------------------------------------------------------------ main loop

    def run(self) -> SimResult:
        """Simulate until `steps` optimizer updates completed; returns the summary."""
        started = time.perf_counter()
        for c in range(self.sched_config.cells):
            self.timeline.append((0.0, c, self.scheduler.roles[c].value))
        self._feed(ev.Start())
        while len(self.step_end) < self.steps:
            if not self.queue:
                raise SchedulerError(
                    f"simulation stalled after {len(self.step_end)} steps "
                    f"(waterlevel {self.scheduler.waterlevel}, phase {self.scheduler.phase.value})"
                )
            t, _, kind, a, b = heapq.heappop(self.queue)
            self.now = t
            self._on_timer(kind, a, b)
        return summarize(self, time.perf_counter() - started)

    def _at(self, delay: float, kind: int, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self.queue, (self.now + delay, next(self.seq), kind, a, b))

    def _feed(self, event: ev.Event) -> None:
        self.pending.append(event)
        if len(self.pending) > 1:
            return  # an outer _feed is draining the queue
        while self.pending:
            for action in self.scheduler.handle(self.pending[0]):
                self._apply(action)
            self.pending.popleft()

    # ------------------------------------------------------------------ timers

    def _on_timer(self, kind: int, a: int, b: int) -> None:
        if kind == ENGINE:
            if b == self.pool.stamp[a]:
                self._engine_due(a)
        elif kind == TIMEOUT:
            if self.pool.engine_of(a) is not None:
                self._terminate(a, ev.Outcome.HARNESS_TIMEOUT)
        elif kind == EVALUATED:
            g = a // self.sched_config.group_size
            self.evaluated[g] += 1
            if self.evaluated[g] == self.sched_config.group_size:
                self._feed(ev.GroupReady(g))
        elif kind == SWITCH:
            self._feed(ev.SwitchDone(a))
            self.timeline.append((self.now, a, self.scheduler.roles[a].value))
        elif kind == MICRO:
            self._feed(ev.MicroStepDone(cell=a, batch=b))
        elif kind == UPDATE:
            self.step_end.append(self.now)
            self._feed(ev.BatchDone(a))
        elif kind == PUBLISH:
            self._feed(ev.WeightsPublished(a))

    def _engine_due(self, e: int) -> None:
        nxt = self.pool.next_completion(e)
        if nxt is None:
            return
        when, x = nxt
        if when > self.now + 1e-6:
            self._at(when - self.now, ENGINE, e, self.pool.stamp[e])
            return
        self._terminate(x, ev.Outcome.COMPLETED)

    def _retime(self, e: int) -> None:
        nxt = self.pool.next_completion(e)
        if nxt is not None:
            self._at(max(0.0, nxt[0] - self.now), ENGINE, e, self.pool.stamp[e])

    def _terminate(self, x: int, outcome: ev.Outcome) -> None:
        e = self.pool.where[x]
        self.pool.remove(x, self.now)
        self._retime(e)
        self.end_t[x] = self.now
        self.outcome[x] = outcome.value
        deadline = self.launch_t[x] + self.config.workload.overall_timeout_h * HOUR
        done = self.now + self.eval_s[x]
        self.valid[x] = done <= deadline
        self._at(min(done, deadline) - self.now, EVALUATED, x)
        self._feed(ev.Terminated(x, outcome))

    # ------------------------------------------------------------------ actions

    def _apply(self, action: ev.Action) -> None:
        handler = _ACTIONS[type(action)]
        handler(self, action)

    def _dispatch(self, a: ev.Dispatch) -> None:
        sample = self.workload.sample_group()
        self.nominal.extend(sample.nominal_s.tolist())
        self.eval_s.extend(sample.eval_s.tolist())
        n = len(a.executions)
        self.launch_t.extend([-1.0] * n)
        self.end_t.extend([-1.0] * n)
        self.valid.extend([False] * n)
        self.outcome.extend([""] * n)
        self.evaluated.append(0)

    def _launch(self, a: ev.Launch) -> None:
        x = a.execution
        self.launch_t[x] = self.now
        self.pool.add(x, a.engine, self.nominal[x], self.now)
        self._retime(a.engine)
        timeout = self.config.workload.harness_timeout_h * HOUR
        if self.nominal[x] > timeout:  # rate >= 1 at loads <= the limit: others finish first
            self._at(timeout, TIMEOUT, x)

    def _reroute(self, a: ev.Reroute) -> None:
        self.reroutes += 1
        remaining = self.pool.remove(a.execution, self.now)
        penalty = self.config.costs.reroute_penalty_s
        self.pool.add(a.execution, a.destination, remaining + penalty, self.now)
        self._retime(a.source)
        self._retime(a.destination)

    def _switch(self, a: ev.SwitchCell) -> None:
        costs = self.config.costs
        cost = costs.switch_to_train_s if a.role is ev.Role.TRAIN else costs.switch_to_rollout_s
        self.timeline.append((self.now, a.cell, self.scheduler.roles[a.cell].value))
        self._at(cost, SWITCH, a.cell)

    def _admit(self, a: ev.AdmitGroup) -> None:
        self.staleness.append(a.staleness)
        self.batch_groups.setdefault(a.batch, []).append(a.group)
        n = self.sched_config.group_size
        tokens = [
            self.workload.train_tokens(self.end_t[x] - self.launch_t[x])
            for x in range(a.group * n, (a.group + 1) * n)
            if self.valid[x]
        ]
        self.batch_tokens.setdefault(a.batch, deque()).extend(tokens)
        self._feed(ev.MicroStepsQueued(batch=a.batch, group=a.group, count=len(tokens)))

    def _claim(self, a: ev.ClaimMicroStep) -> None:
        tokens = self.batch_tokens[a.batch].popleft()
        duration = tokens / self.cell_tokens_s
        if (a.cell, a.batch) not in self.filled:
            self.filled.add((a.cell, a.batch))
            duration += self.config.costs.pipeline_fill_s
        self._at(duration, MICRO, a.cell, a.batch)

    def _update(self, a: ev.OptimizerUpdate) -> None:
        self.batch_tokens.pop(a.batch, None)
        self._at(self.config.costs.update_s, UPDATE, a.batch)

    def _publish(self, a: ev.Publish) -> None:
        self._at(self.config.costs.publish_s, PUBLISH, a.version)

    def _window(self, a: ev.OpenJoinWindow | ev.CloseJoinWindow) -> None:
        kind = "open" if isinstance(a, ev.OpenJoinWindow) else "close"
        self.windows.append((self.now, a.batch, kind))


_ACTIONS: dict[type, Callable[[Simulator, Any], None]] = {
    ev.Dispatch: Simulator._dispatch,
    ev.Launch: Simulator._launch,
    ev.Reroute: Simulator._reroute,
    ev.SwitchCell: Simulator._switch,
    ev.AdmitGroup: Simulator._admit,
    ev.ClaimMicroStep: Simulator._claim,
    ev.OptimizerUpdate: Simulator._update,
    ev.Publish: Simulator._publish,
    ev.OpenJoinWindow: Simulator._window,
    ev.CloseJoinWindow: Simulator._window,
}
