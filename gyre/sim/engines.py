"""Rollout engines under processor sharing: generation slows down as concurrency grows.

Each engine keeps a *virtual clock* V that advances at the engine's current progress rate;
every execution on it finishes when V reaches the execution's target (launch-time V plus its
nominal duration). All executions on one engine share the rate, so a per-engine heap of
targets gives the next completion in O(log n), and a load change only re-times that engine's
head (docs/simulator.md, "Throughput saturation").

One cost model per engine size (`EngineModel`): an engine of `nodes` nodes has concurrency
limit c (its reference load, where nominal durations hold) and saturates at
h = `half_per_node` x nodes, so engines of every size follow the same curve in load per
node — a lone execution on an idle 8-node engine is as much faster as on an idle 4-node one:

    rate(n) = (g s(c) + 1 - g) / (g s(n) + 1 - g),  s(n) = (n + h) / (1 + h)

with g the generation share of an execution's time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineModel:
    """Progress rate of an engine's executions as a function of its load, for one size."""

    reference_load: int
    """c: the engine's concurrency limit; an execution's nominal duration holds at this load."""
    half: float
    """h: the load at which per-call generation time doubles (throughput saturation)."""
    generation_share: float
    """g: share of an execution's time spent waiting for model calls."""

    @classmethod
    def for_size(
        cls, nodes: int, concurrency: int, generation_share: float, half_per_node: float
    ) -> EngineModel:
        return cls(concurrency, half_per_node * nodes, generation_share)

    def cost(self, n: int) -> float:
        """Relative time of one unit of work at load n (per-call time grows with the load)."""
        g = self.generation_share
        return g * (max(n, 1) + self.half) / (1.0 + self.half) + 1.0 - g

    def rate(self, n: int) -> float:
        """Progress per second of each of n executions, 1 at the reference load."""
        return self.cost(self.reference_load) / self.cost(n)


class EnginePool:
    """Loads, virtual clocks and per-engine target heaps of all rollout engines."""

    def __init__(self, engines: int, model: EngineModel) -> None:
        self.model = model
        self._rates = [model.rate(n) for n in range(4 * model.reference_load + 2)]
        self.load = [0] * engines
        self.rate = [self._rates[0]] * engines
        self.clock = [0.0] * engines  # V
        self.synced = [0.0] * engines  # wall time V was last advanced to
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in range(engines)]
        self.stamp = [0] * engines
        self.where: dict[int, int] = {}
        self.target: dict[int, float] = {}
        self.busy_slot_s = 0.0

    def _sync(self, e: int, now: float) -> None:
        dt = now - self.synced[e]
        if dt > 0:
            self.clock[e] += self.rate[e] * dt
            self.busy_slot_s += self.load[e] * dt
            self.synced[e] = now

    def _set_load(self, e: int, delta: int) -> None:
        n = self.load[e] + delta
        self.load[e] = n
        self.rate[e] = self._rates[n] if n < len(self._rates) else self.model.rate(n)
        self.stamp[e] += 1

    def add(self, x: int, e: int, work_s: float, now: float) -> None:
        """Start `work_s` nominal seconds of execution `x` on engine `e`."""
        self._sync(e, now)
        self._set_load(e, +1)
        t = self.clock[e] + work_s
        self.where[x] = e
        self.target[x] = t
        heapq.heappush(self.heaps[e], (t, x))

    def remove(self, x: int, now: float) -> float:
        """Take `x` off its engine; returns its remaining nominal work."""
        e = self.where.pop(x)
        self._sync(e, now)
        self._set_load(e, -1)
        return max(0.0, self.target.pop(x) - self.clock[e])

    def engine_of(self, x: int) -> int | None:
        return self.where.get(x)

    def next_completion(self, e: int) -> tuple[float, int] | None:
        """(wall time, execution) of the engine's next completion, dropping stale entries."""
        heap = self.heaps[e]
        where, target = self.where, self.target
        while heap:
            t, x = heap[0]
            if where.get(x) == e and target[x] == t:
                wall = self.synced[e] + max(0.0, t - self.clock[e]) / self.rate[e]
                return wall, x
            heapq.heappop(heap)
        return None
