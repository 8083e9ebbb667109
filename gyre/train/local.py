"""One batch on cells inside this process: the single-process reference of the MPI world.

`train_batch_local` runs exactly the two-phase batch that `gyre.train.world` spreads over an
MPI world (phase A prepass, per-execution scalars, phase B accumulation, gradient sum, one
core update), with micro-steps assigned to in-process cells by a given list. It is the
reference the distributed tests compare against, the embedded trainer for tiny CPU runs and
what the benchmark times.

    stats = train_batch_local([cell], optimizer, steps, info, objective=ObjectiveConfig())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyre.errors import TrainingError
from gyre.train.cell import CoreOptimizer, TorchCell
from gyre.train.objective import ObjectiveConfig, execution_scalars, merge_sums
from gyre.train.packing import MicroStep
from gyre.train.stream import BatchInfo


@dataclass(slots=True)
class BatchStats:
    """What one local batch reports."""

    targets: int
    objective: float  # J at the batch's weights
    clipped_executions: int
    grad_norm: float  # before clipping
    grad_sum: torch.Tensor  # the summed batch gradient (before clipping)


def train_batch_local(
    cells: Sequence[TorchCell],
    optimizer: CoreOptimizer,
    steps: Sequence[MicroStep],
    info: BatchInfo,
    *,
    objective: ObjectiveConfig,
    assignment: Sequence[int] | None = None,
) -> BatchStats:
    """Phases A and B over `steps` (step k on cell assignment[k]), then one core update.

    cells[0] must be the optimizer's cell (the core); the others get its weights afterwards.
    """
    if not steps:
        raise TrainingError("empty batch: no micro-steps to train on")
    if info.num_executions == 0:
        raise TrainingError("empty batch: no execution contributes targets")
    owner = list(assignment) if assignment is not None else [0] * len(steps)
    if len(owner) != len(steps) or not all(0 <= c < len(cells) for c in owner):
        raise TrainingError(f"assignment: {owner!r} must name a cell 0..{len(cells) - 1} per step")
    sums = merge_sums([cells[c].prepass(s) for s, c in zip(steps, owner)])
    scalars = execution_scalars(sums, info.executions, objective)
    for cell in cells:
        cell.zero_grad()
    done = [cells[c].accumulate(s, scalars, info.num_executions) for s, c in zip(steps, owner)]
    total = cells[0].flat_grads.clone()
    for cell in cells[1:]:
        total += cell.flat_grads
    norm = optimizer.step(total)
    for cell in cells:
        cell.zero_grad()
        if cell is not cells[0]:
            cell.load_params(cells[0].flat_params)
    return BatchStats(
        targets=sum(d.targets for d in done),
        objective=sum(d.objective for d in done),
        clipped_executions=sum(1 for s in scalars.values() if s.gate == 0.0),
        grad_norm=norm,
        grad_sum=total,
    )
