"""Typed configuration of the scheduler: the cluster's cells, the RL batch shape, dispatch.

`ScheduleConfig` is the batch shape and dispatch (N, k, B, φ, μ, supply and join thresholds,
a cell engine's concurrency): declared here once, embedded by the run config's `schedule:`
section (`gyre.runtime.shared.config.RunSchedule`) and by the simulator's templates.
`Config` is a `ScheduleConfig` on a machine (cells, standalone pool, the priors of the online
cost estimates); `PolicyConfig` picks Elastic, Async or Colocate and the Table 1 knobs that
only a policy reads (streaming, the Async training split). Each validates in `__post_init__`
and raises `ConfigError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from gyre.errors import ConfigError

POLICIES = ("elastic", "async", "colocate")


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """The RL batch shape and boundary dispatch: what a run config's `schedule:` section
    sets and the scheduler runs with (defaults: the paper's cluster runs; the one-machine
    values are in templates/local.yaml)."""

    concurrency_per_cell: int = 144
    """Executions one cell-sized rollout engine serves at once."""
    group_size: int = 16
    """N: executions per rollout group (the ones a group trains)."""
    oversample: int = 0
    """k: extra executions launched per group; the first N valid to settle train, the surplus
    is cancelled (docs/scheduler.md "Oversampling"). 0: exactly N launched."""
    batch_groups: int = 32
    """B: groups per training step."""
    phi: float = 0.5
    """φ: extra dispatch in units of B groups (φB is rounded half up to whole groups)."""
    mu: int = 3
    """μ: training steps per burst (one weight publication per burst)."""
    supply_fraction: float = 0.25
    """Streaming supply check: ready or soon-ready groups needed, as a fraction of B."""
    join_min_microsteps: int = 16
    """A satellite joins a batch only if at least this many micro-step passes are left for it."""
    join_payback: float = 1.0
    """Cost-aware join: a satellite's share of the batch's work left when it arrives must be
    at least this many times its round-trip switch time (0: the count check alone)."""
    window: int | Literal["auto"] = "auto"
    """Micro-steps a training cell takes per pass, at most: the ones queued when it claims,
    run as one window (1F1B through a Megatron cell's pipeline stages; docs/gpu.md). auto:
    2 x the cell's pipeline stages P when P > 1 (each stage then idles (P - 1) / (3P - 1) of
    a full window, not (P - 1) / P), else 1 (`window_for`)."""

    def __post_init__(self) -> None:
        _positive("concurrency_per_cell", self.concurrency_per_cell)
        _positive("group_size", self.group_size)
        _count("oversample", self.oversample)
        _positive("batch_groups", self.batch_groups)
        if not self.phi >= 0:
            raise ConfigError(f"phi: {self.phi} is negative; allowed φ >= 0")
        if self.mu < 1:
            raise ConfigError(f"mu: {self.mu}; allowed μ >= 1 (integer)")
        if not 0 < self.supply_fraction <= 1:
            raise ConfigError(f"supply_fraction: {self.supply_fraction}; allowed 0 < x <= 1")
        if self.join_min_microsteps < 0:
            raise ConfigError(f"join_min_microsteps: {self.join_min_microsteps}; allowed >= 0")
        _finite("join_payback", self.join_payback)
        if self.window != "auto":
            _positive("window", self.window, also="auto or ")

    @property
    def executions_per_group(self) -> int:
        """N + k: executions dispatched per group (group g owns g(N+k) .. g(N+k)+N+k-1)."""
        return self.group_size + self.oversample

    @property
    def extra_groups(self) -> int:
        """φB rounded to whole groups."""
        return math.floor(self.phi * self.batch_groups + 0.5)

    def window_for(self, stages: int) -> int:
        """The window a cell of `stages` pipeline stages claims: `window` when it is a
        number; auto, 2 x stages when the cell is pipelined (enough micro-steps to fill the
        stages' 1F1B warm-up twice over), else 1. The one place auto is resolved: the run
        passes its training layout's stages (`RunSchedule.scheduler`), the simulator its
        modelled ones (`SimConfig.scheduler_for`)."""
        if self.window != "auto":
            return self.window
        return 2 * stages if stages > 1 else 1

    def shape(self) -> dict[str, Any]:
        """This schedule's own fields by name (to build a `Config` around them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ScheduleConfig)}


@dataclass(kw_only=True, slots=True)
class Config(ScheduleConfig):
    """The scheduler's whole config: a `ScheduleConfig` on a machine of cells, a standalone
    pool, and the priors of the online cost estimates."""

    nodes: int = 32
    """Nodes in the elastic cells (standalone nodes not included)."""
    cells: int = 8
    """K: number of cells; cell 0 is the core, the rest are satellites in this order."""
    train_layout_nodes: int = 4
    """Nodes one training replica needs (its TP x PP x EP x CP layout); a cell holds a multiple."""
    standalone_nodes: int = 0
    """Nodes that stay in rollout; grouped into engines of one cell's size and concurrency."""
    engines_per_cell: int = 1
    """Rollout engines of one cell (a runtime cell's `engine.per_cell`): the cell's
    `concurrency_per_cell` executions are split evenly over them (`engine_concurrency`)."""
    switch_to_train_prior_s: float = 8.52
    """Rollout -> training switch seconds of a cell until one is measured (paper §6.2)."""
    switch_to_rollout_prior_s: float = 3.46
    """Training -> rollout switch seconds of a cell until one is measured (paper §6.2)."""
    prepass_prior_s: float = 5.0
    """Seconds of one micro-step prepass (no-grad forward) until one is measured."""
    gradient_prior_s: float = 15.0
    """Seconds of one micro-step gradient pass (forward + backward) until one is measured."""
    cost_smoothing: float = 0.25
    """Weight of a new measurement in the running cost estimates (the first replaces the prior)."""

    def __post_init__(self) -> None:
        _positive("nodes", self.nodes)
        _positive("cells", self.cells)
        if self.cells > self.nodes:
            raise ConfigError(
                f"cells: {self.cells} is more than nodes ({self.nodes}); allowed 1..{self.nodes}"
            )
        if self.nodes % self.cells:
            raise ConfigError(
                f"cells: {self.cells} does not divide nodes ({self.nodes}); "
                "allowed: a divisor of nodes"
            )
        _positive("train_layout_nodes", self.train_layout_nodes)
        if self.nodes_per_cell % self.train_layout_nodes:
            raise ConfigError(
                f"train_layout_nodes: {self.train_layout_nodes} does not fit a cell of "
                f"{self.nodes_per_cell} nodes; allowed: a divisor of nodes/cells"
            )
        ScheduleConfig.__post_init__(self)  # slots dataclass: no zero-argument super()
        _positive("engines_per_cell", self.engines_per_cell)
        if self.concurrency_per_cell % self.engines_per_cell:
            raise ConfigError(
                f"concurrency_per_cell: {self.concurrency_per_cell} does not split over "
                f"{self.engines_per_cell} engines per cell; allowed: a multiple of "
                f"{self.engines_per_cell}"
            )
        if self.standalone_nodes < 0 or self.standalone_nodes % self.nodes_per_cell:
            raise ConfigError(
                f"standalone_nodes: {self.standalone_nodes}; allowed: a multiple of the "
                f"cell size ({self.nodes_per_cell}), 0 or more"
            )
        for name in ("switch_to_train_prior_s", "switch_to_rollout_prior_s", "prepass_prior_s",
                     "gradient_prior_s"):  # fmt: skip
            _finite(name, getattr(self, name))
        if not 0 < self.cost_smoothing <= 1:
            raise ConfigError(f"cost_smoothing: {self.cost_smoothing}; allowed 0 < x <= 1")

    @property
    def nodes_per_cell(self) -> int:
        return self.nodes // self.cells

    @property
    def standalone_engines(self) -> int:
        return self.standalone_nodes // self.nodes_per_cell

    @property
    def engine_concurrency(self) -> int:
        """Executions one of a cell's engines serves: the cell's share over its engines.
        The one place a cell's rollout capacity is counted in engines (the scheduler's
        `Engines` and the simulator's engine pool both read it)."""
        return self.concurrency_per_cell // self.engines_per_cell

    @property
    def engines(self) -> int:
        """Every rollout engine: the cells' (engines_per_cell each), then the standalone."""
        return self.cells * self.engines_per_cell + self.standalone_engines


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """Which placement policy runs over the machine, and its Table 1 knobs."""

    name: Literal["elastic", "async", "colocate"] = "elastic"
    """elastic (cells switch one by one), async (fixed split), colocate (whole pool switches)."""
    streaming: bool = True
    """Start a batch on part of its groups and stream the rest in (else wait for B ready)."""
    train_cells: int = 1
    """Async only: cells (core first) fixed in training; the others stay in rollout."""

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"name: {self.name!r} is unknown; allowed: {', '.join(POLICIES)}")
        _positive("train_cells", self.train_cells)


def _positive(name: str, value: int, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: {value!r}; allowed: {also}an integer >= 1")


def _finite(name: str, value: float) -> None:
    if not 0 <= value < math.inf:
        raise ConfigError(f"{name}: {value}; allowed: a finite number >= 0")


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}: {value!r}; allowed: an integer >= 0")
