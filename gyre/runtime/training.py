"""The coordinator's side of streaming training: packing buffer, micro-step queue, scalars.

Mapping of the scheduler's actions onto the two-phase objective (docs/objective.md):

* `AdmitGroup` — the group's outcomes and trees enter the `StreamPackingBuffer`, which
  runs admission (≤ J_max trajectories per execution) and packs new micro-steps;
* `ClaimMicroStep(cell)` — the cell runs phase A on the next micro-step (no-grad forward:
  per-execution log-ratio sums) while the batch is still streaming in;
* `OptimizerUpdate(cells)` — with every sum in, the coordinator computes each execution's
  sequence ratio and gate; the training cells (a prefix 0..m-1) split the micro-steps for
  phase B, sum gradients to the core over `prefix[m]`, the core steps AdamW once and
  broadcasts the parameters.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gyre.errors import TrainingError
from gyre.train.admission import AdmissionConfig
from gyre.train.objective import ObjectiveConfig, execution_scalars, merge_sums
from gyre.train.packing import MicroStep
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.train.stream import ReadyGroup, StreamConfig, StreamPackingBuffer


class TrainingDriver:
    """Batch book-keeping on the coordinator."""

    def __init__(self, *, groups_per_batch: int, group_size: int, token_budget: int,
                 j_max: int, seed: int) -> None:  # fmt: skip
        self.buffer = StreamPackingBuffer(
            StreamConfig(
                groups_per_batch=groups_per_batch,
                group_size=group_size,
                token_budget=token_budget,
                seed=seed,
                admission=AdmissionConfig(j_max=j_max),
            )
        )
        self.objective = ObjectiveConfig()
        self.batch = -1
        self.queue: deque[MicroStep] = deque()
        self.steps: list[MicroStep] = []
        self.sums: dict[int, dict[str, float]] = {}
        self.staleness: list[int] = []
        self.rewards: list[float] = []

    def begin(self, batch: int) -> None:
        self.buffer.begin_batch()
        self.batch = batch
        self.queue.clear()
        self.steps, self.sums, self.staleness, self.rewards = [], {}, [], []

    def admit(self, group_id: str, version: int, staleness: int,
              outcomes: list[ExecutionOutcome], trees: dict[str, Any]) -> int:  # fmt: skip
        """Take a ready group; returns how many micro-steps became claimable."""
        self.staleness.append(staleness)
        self.rewards += [
            o.reward for o in outcomes if o.status is Status.VALID and o.reward is not None
        ]
        self.buffer.add_ready(
            ReadyGroup(group_id=group_id, policy_version=version, outcomes=outcomes, trees=trees)
        )
        new = self.buffer.pull()
        self.steps += new
        self.queue.extend(new)
        return len(new)

    def claim(self) -> MicroStep:
        if not self.queue:
            raise TrainingError(f"batch {self.batch}: a claim found no queued micro-step")
        return self.queue.popleft()

    def prepassed(self, index: int, sums: dict[str, float]) -> None:
        self.sums[index] = sums

    def assignments(self, cells: tuple[int, ...]) -> tuple[dict[int, list[MicroStep]], dict, int]:
        """Phase B: micro-steps per cell (round robin), per-execution scalars and E."""
        if len(self.sums) != len(self.steps):
            raise TrainingError(f"batch {self.batch}: phase A incomplete before the update")
        info = self.buffer.batch_info()
        scalars = execution_scalars(
            merge_sums([self.sums[s.index] for s in self.steps]), info.executions, self.objective
        )
        share: dict[int, list[MicroStep]] = {c: [] for c in cells}
        for k, step in enumerate(sorted(self.steps, key=lambda s: -s.padded_tokens)):
            share[cells[k % len(cells)]].append(step)
        return share, scalars, info.num_executions
