"""Modelled devices: what an accelerator's work costs, for the simulator and the paced runtime.

One cost model of the cluster, shared by `gyre sim` (which advances a virtual clock by these
costs) and the paced runtime (`pace:` in a run config, docs/pacing.md), whose engines and
cells hold each piece of real work until its modelled duration has passed:

* `EngineModel` / `EnginePool`: rollout engines under processor sharing (below);
* `CallCost`: one model call's nominal seconds from its prompt, cached and output tokens;
* `CostConfig`: everything that is not rollout — role switches, publication, the optimizer
  update and the training passes (`pass_s`; a window of them through a pipeline: `window_s`).

Rollout engines under processor sharing: generation slows down as concurrency grows.

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

import dataclasses
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from gyre.errors import ConfigError
from gyre.schedule import pipeline


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
        cls, nodes: float, concurrency: int, generation_share: float, half_per_node: float
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

    def __init__(self, engines: int, model: EngineModel, sizes: Sequence[EngineModel] = ()) -> None:
        """`engines` engines of `model`'s size, the first `len(sizes)` of them each of its own
        (a cell's engines where a cell serves from several: `Simulator`)."""
        self.models = [*sizes, *[model] * (engines - len(sizes))]
        tables = {id(m): [m.rate(n) for n in range(4 * m.reference_load + 2)]
                  for m in self.models}  # fmt: skip
        self._rates = [tables[id(m)] for m in self.models]
        self.load = [0] * engines
        self.rate = [r[0] for r in self._rates]
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
        rates = self._rates[e]
        self.rate[e] = rates[n] if n < len(rates) else self.models[e].rate(n)
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


@dataclass(kw_only=True, slots=True)
class CostConfig:
    """Durations of everything that is not a rollout execution."""

    switch_to_train_s: float = 8.52
    """Rollout -> training switch of one cell (paper §6.2)."""
    switch_to_rollout_s: float = 3.46
    """Training -> rollout switch of one cell (paper §6.2)."""
    publish_s: float = 60.0
    """Weight publication from the core to every rollout engine."""
    update_s: float = 30.0
    """Gradient reduction, clipping and the optimizer update (+ broadcast to satellites)."""
    pipeline_stages: int = 1
    """P: pipeline stages of a modelled cell; a pass's window of m micro-steps runs 1F1B
    through them, each stage idle (P - 1) / (m + P - 1) of it for equal micro-steps
    (`window_s`, `gyre.schedule.pipeline`)."""
    train_tokens_per_node_s: float = 3_000.0
    """Gradient-pass (forward + backward) throughput of one node, tokens per second."""
    prepass_ratio: float = 1 / 3
    """A prepass (no-grad forward) costs this share of a gradient pass over the same tokens."""
    microstep_tokens: float = 0.0
    """Tokens packed into one micro-step; 0: one micro-step per execution."""
    reroute_penalty_s: float = 30.0
    """Extra generation time of a rerouted execution (prefix recomputation)."""
    startup_s: float = 0.0
    """Job start-up before the first dispatch, added to the total (replays fit it)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise ConfigError(f"{f.name}: {value}; allowed >= 0")
        if self.pipeline_stages < 1:
            raise ConfigError(f"pipeline_stages: {self.pipeline_stages}; allowed >= 1")
        if not self.train_tokens_per_node_s > 0:
            raise ConfigError(
                f"train_tokens_per_node_s: {self.train_tokens_per_node_s}; allowed > 0"
            )

    def switch_s(self, to_train: bool) -> float:
        """One cell's role switch: rollout -> training, or back."""
        return self.switch_to_train_s if to_train else self.switch_to_rollout_s

    def pass_s(self, tokens: float, nodes: int, *, prepass: bool) -> float:
        """A cell of `nodes` nodes passing `tokens` training tokens: a gradient pass (forward
        + backward), or a prepass (one forward, `prepass_ratio` of that)."""
        seconds = tokens / (nodes * self.train_tokens_per_node_s)
        return seconds * self.prepass_ratio if prepass else seconds

    def window_s(self, tokens: Sequence[float], nodes: int, *, prepass: bool) -> float:
        """A cell's pass over a window of micro-steps (`tokens` each) through
        `pipeline_stages` stages in the runtime's 1F1B order (`gyre.schedule.pipeline`): a
        stage's share of a micro-step takes the whole cell's pass time (1/P of the layers on
        1/P of the nodes), a gradient pass's forward `prepass_ratio` of it."""
        if prepass:
            return pipeline.window_s([self.pass_s(t, nodes, prepass=True) for t in tokens],
                                     None, self.pipeline_stages)  # fmt: skip
        passes = [self.pass_s(t, nodes, prepass=False) for t in tokens]
        forward = [p * min(1.0, self.prepass_ratio) for p in passes]
        backward = [p - f for p, f in zip(passes, forward, strict=True)]
        return pipeline.window_s(forward, backward, self.pipeline_stages)


@dataclass(kw_only=True, slots=True)
class CallCost:
    """Nominal seconds of one model call on an engine at its reference load."""

    prefill_tokens_per_s: float = 20_000.0
    """Prompt tokens per second of a call's prefill (tokens found in the prefix cache are free)."""
    decode_s_per_token: float = 0.05
    """Seconds per output token."""

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ConfigError(f"prefill_tokens_per_s: {self.prefill_tokens_per_s}; allowed > 0")
        if not self.decode_s_per_token >= 0:
            raise ConfigError(f"decode_s_per_token: {self.decode_s_per_token}; allowed >= 0")

    def nominal_s(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """A call's seconds at the engine's reference load: prefill of what the cache did not
        hold (a rerouted call recomputes its prefix: the reroute penalty) plus decode."""
        prefill = max(0, prompt_tokens - cached_tokens) / self.prefill_tokens_per_s
        return prefill + output_tokens * self.decode_s_per_token


@dataclass(kw_only=True, slots=True)
class EnginePace:
    """What one paced engine paces its calls with (`gyre engine --pace JSON`, the JSON of
    this record; `gyre.rollout.pacing.PacedCalls`)."""

    scale: float
    """Modelled seconds per wall second."""
    model: EngineModel
    """The engine's load curve (`PaceConfig.engine_model`)."""
    calls: CallCost = field(default_factory=CallCost)
    """A call's nominal seconds."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


@dataclass(kw_only=True, slots=True)
class PaceConfig:
    """Paced devices: the runtime's engines and cells take the modelled time of a cluster's.

    Real work (the model's tokens, real training) is held until its modelled duration, divided
    by `scale`, has passed; a paced run's wall seconds times `scale` are modelled seconds.
    Everything that is not a device — harness processes, tool latency, timeouts — runs in
    wall time as configured (give it in wall seconds).
    """

    scale: float = 0.0
    """Modelled seconds per wall second; 0: not paced (every duration is measured)."""
    nodes_per_cell: int = 4
    """Modelled accelerator nodes of one cell (its engine's size and its training throughput);
    a standalone engine is one cell's size."""
    saturation_half_per_node: float = 36.0
    """Calls in flight per engine node at which a call's time doubles (throughput saturation,
    `EngineModel`)."""
    calls: CallCost = field(default_factory=CallCost)
    """What one model call costs."""
    costs: CostConfig = field(default_factory=CostConfig)
    """Switches, publication, update and training passes (through pipeline stages)."""

    def __post_init__(self) -> None:
        if not self.scale >= 0:
            raise ConfigError(f"scale: {self.scale}; allowed: 0 (off) or > 0")
        if self.nodes_per_cell < 1:
            raise ConfigError(f"nodes_per_cell: {self.nodes_per_cell}; allowed >= 1")
        if not self.saturation_half_per_node > 0:
            raise ConfigError(
                f"saturation_half_per_node: {self.saturation_half_per_node}; allowed > 0"
            )

    @property
    def enabled(self) -> bool:
        return self.scale > 0

    def engine(self, concurrency: int) -> EnginePace:
        """What a paced engine of a cell with `concurrency` executions is paced with."""
        return EnginePace(scale=self.scale, model=self.engine_model(concurrency),
                          calls=self.calls)  # fmt: skip

    def engine_model(self, concurrency: int) -> EngineModel:
        """A paced engine's load curve. Its "executions" are model calls, all generation
        (g = 1): tool time is the harness's own wall time."""
        return EngineModel.for_size(self.nodes_per_cell, concurrency, 1.0,
                                    self.saturation_half_per_node)  # fmt: skip
