"""The stream packing buffer and the shared micro-step queue (§4.4 "Streaming training").

`StreamPackingBuffer` receives *ready* groups (all N executions closed, outcomes resolved) and
turns them into micro-steps on demand: `pull()` takes the ready group with the oldest policy
version, computes its group-relative advantages, runs admission on every execution's tree,
materializes token rows and packs them. It selects the batch's B groups incrementally and
closes the stream after the last group's micro-steps are emitted; the batch's execution table
(advantage and L_i per execution, E) is then final. A group with fewer than `min_outcomes`
usable outcomes is set aside (its slot counts, its executions add no row); a batch left with
nothing to train closes with E = 0 (docs/training.md "Valid groups").

The coordinator's `gyre.runtime.coordinator.training.TrainingPlane` queues the emitted micro-steps for
the cells to claim (docs/training.md).

    buf = StreamPackingBuffer(StreamConfig(groups_per_batch=2, group_size=4, token_budget=4096))
    buf.add_ready(group)
    steps = buf.pull()               # repeat while groups arrive; buf.closed ends the stream
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import ConfigError, TrainingError
from gyre.train.admission import AdmissionConfig, AdmissionTree, admit, derive_seed
from gyre.train.packing import MicroStep, TokenRow, materialize_execution, pack_rows
from gyre.train.rewards import (
    AdvantageConfig,
    ExecutionOutcome,
    Status,
    group_advantages,
    group_ready,
)


@dataclass(kw_only=True, slots=True)
class StreamConfig:
    """Batch shape and packing parameters."""

    groups_per_batch: int = 32
    """B: groups consumed by one optimizer update."""
    group_size: int = 16
    """N: executions per rollout group."""
    token_budget: int = 16384
    """Most padded tokens (rows x longest row) in one micro-step."""
    seed: int = 0
    """Seed of admission sampling (combined with each execution id)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """The admission rule (J_max, role priority)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage normalization."""
    min_outcomes: int = 1
    """A group with fewer usable outcomes (not EXCLUDED) is set aside, not trained (a run
    takes `train.min_group_outcomes`)."""

    def __post_init__(self) -> None:
        for name in ("groups_per_batch", "group_size", "token_budget"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: {v!r}; allowed an int >= 1")
        if not isinstance(self.min_outcomes, int) or self.min_outcomes < 1:
            raise ConfigError(f"min_outcomes: {self.min_outcomes!r}; allowed an int >= 1")


@dataclass(kw_only=True, slots=True)
class ReadyGroup:
    """A rollout group whose executions are all closed with resolved outcomes."""

    group_id: str
    policy_version: int
    outcomes: list[ExecutionOutcome]
    trees: Mapping[str, Any]  # execution id -> TrajectoryTree (VALID executions need one)


@dataclass(slots=True)
class BatchInfo:
    """The closed batch's execution table."""

    executions: dict[str, tuple[float, int]]  # execution id -> (advantage, L_i)
    group_ids: list[str]
    policy_versions: list[int]
    rows: dict[str, int] = field(default_factory=dict)  # execution id -> its token rows
    set_aside: list[str] = field(default_factory=list)  # groups with too few usable outcomes

    @property
    def num_executions(self) -> int:
        """E: executions contributing targets to the batch (0: nothing to train; the
        update is skipped)."""
        return len(self.executions)


class StreamPackingBuffer:
    """Ready groups in, micro-steps out; one batch at a time."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self._ready: list[tuple[int, int, ReadyGroup]] = []
        self._arrivals = 0
        self._pending: list[TokenRow] = []
        self._next_index = 0
        self._batch = BatchInfo(executions={}, group_ids=[], policy_versions=[])
        self.closed = False

    def add_ready(self, group: ReadyGroup) -> None:
        """Accept a ready group (validated now, so a bad group never enters a batch)."""
        if not group_ready(group.outcomes, self.config.group_size):
            raise TrainingError(
                f"group {group.group_id!r}: not ready (missing executions/outcomes)"
            )
        group_advantages(
            group.outcomes, group_size=self.config.group_size, config=self.config.advantage
        )
        for o in group.outcomes:
            if o.status is Status.VALID and o.execution_id not in group.trees:
                raise TrainingError(f"group {group.group_id!r}: no tree for {o.execution_id!r}")
        heapq.heappush(self._ready, (group.policy_version, self._arrivals, group))
        self._arrivals += 1

    @property
    def ready_groups(self) -> int:
        """Ready groups waiting for a batch."""
        return len(self._ready)

    def begin_batch(self) -> None:
        """Start selecting a new batch (after the previous one was closed and consumed)."""
        self._pending, self._next_index, self.closed = [], 0, False
        self._batch = BatchInfo(executions={}, group_ids=[], policy_versions=[])

    def pull(self) -> list[MicroStep]:
        """Take the oldest-version ready group (if the batch needs one); new micro-steps."""
        if self.closed:
            return []
        if self._ready and len(self._batch.group_ids) < self.config.groups_per_batch:
            _, _, group = heapq.heappop(self._ready)
            self._pending += self._group_rows(group)
        full = len(self._batch.group_ids) == self.config.groups_per_batch
        steps = pack_rows(
            self._pending, token_budget=self.config.token_budget, first_index=self._next_index
        )
        if full:
            self.closed, self._pending = True, []
        else:
            keep = steps.pop() if steps else None
            self._pending = list(keep.rows) if keep else []
        self._next_index += len(steps)
        return steps

    def batch_info(self) -> BatchInfo:
        """The batch's execution table; only final once `closed`."""
        return self._batch

    def _group_rows(self, group: ReadyGroup) -> list[TokenRow]:
        cfg = self.config
        adv = group_advantages(group.outcomes, group_size=cfg.group_size, config=cfg.advantage)
        rows: list[TokenRow] = []
        self._batch.group_ids.append(group.group_id)
        self._batch.policy_versions.append(group.policy_version)
        if len(adv) < cfg.min_outcomes:  # advantages of too few outcomes: not a valid group
            self._batch.set_aside.append(group.group_id)
            return rows
        for o in group.outcomes:
            if o.status is not Status.VALID:
                continue  # placeholders carry no targets; excluded executions are dropped
            tree = group.trees[o.execution_id]
            picked = admit(
                AdmissionTree.from_tree(tree),
                config=cfg.admission,
                seed=derive_seed(cfg.seed, o.execution_id),
            )
            got = materialize_execution(
                tree,
                picked,
                advantage=adv[o.execution_id],
                group_id=group.group_id,
                policy_version=group.policy_version,
            )
            if got:
                self._batch.executions[o.execution_id] = (
                    adv[o.execution_id],
                    got[0].execution_targets,
                )
                self._batch.rows[o.execution_id] = len(got)
            rows += got
        return rows
