"""Rollout engines under processor sharing: generation slows down as concurrency grows.

Each engine keeps a *virtual clock* V that advances at the engine's current progress rate;
every execution on it finishes when V reaches the execution's target (launch-time V plus its
nominal duration). All executions on one engine share the rate, so a per-engine heap of
targets gives the next completion in O(log n), and a load change only re-times that engine's
head (docs/simulator.md, "Throughput saturation").

rate(n) = (g s(c) + 1 - g) / (g s(n) + 1 - g),  s(n) = (n + h) / (1 + h)

with g the generation share of an execution's time, h the saturation half-load and c the
reference load (the concurrency limit) at which nominal durations are calibrated.
"""

from __future__ import annotations

import heapq


class EnginePool:
    """Loads, virtual clocks and per-engine target heaps of all rollout engines."""

    def __init__(self, engines: int, reference_load: int, generation_share: float, half: float):
        self.g = generation_share
        self.half = half
        self.base = self._cost(reference_load)
        self.load = [0] * engines
        self.rate = [1.0] * engines
        self.clock = [0.0] * engines  # V
        self.synced = [0.0] * engines  # wall time V was last advanced to
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in range(engines)]
        self.stamp = [0] * engines
        self.where: dict[int, int] = {}
        self.target: dict[int, float] = {}
        self.busy_slot_s = 0.0

    def _cost(self, n: int) -> float:
        return self.g * (max(n, 1) + self.half) / (1.0 + self.half) + 1.0 - self.g

    def _sync(self, e: int, now: float) -> None:
        dt = now - self.synced[e]
        if dt > 0:
            self.clock[e] += self.rate[e] * dt
            self.busy_slot_s += self.load[e] * dt
            self.synced[e] = now

    def _set_load(self, e: int, delta: int) -> None:
        self.load[e] += delta
        self.rate[e] = self.base / self._cost(self.load[e])
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
        while heap:
            t, x = heap[0]
            if self.where.get(x) == e and self.target[x] == t:
                wall = self.synced[e] + max(0.0, t - self.clock[e]) / self.rate[e]
                return wall, x
            heapq.heappop(heap)
        return None
