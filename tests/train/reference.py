"""The slow, obvious single-process reference of one batch (tests only).

Phase A (prepass) over every micro-step, the per-execution scalars, phase B (gradient) on
whichever in-process cell `assignment` names, the summed gradient times 1/E, one core
update: what the runtime's distributed protocol must reproduce for any split of the work.

    stats = train_batch_reference([cell], optimizer, steps, info, objective=ObjectiveConfig())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyre.errors import TrainingError
from gyre.train.cell import CoreOptimizer, TorchCell
from gyre.train.objective import ObjectiveConfig, batch_gradient, execution_scalars, merge_sums
from gyre.train.packing import MicroStep
from gyre.train.stream import BatchInfo


@dataclass(slots=True)
class BatchStats:
    """What one reference batch reports."""

    targets: int
    objective: float  # E * J at the batch's weights
    clipped_executions: int
    grad_norm: float  # of grad J, before clipping
    grad_sum: torch.Tensor  # the micro-steps' summed gradient (before 1/E and clipping)


def batch_gradient_sum(
    cells: Sequence[TorchCell], steps: Sequence[MicroStep], info: BatchInfo, *,
    objective: ObjectiveConfig, assignment: Sequence[int] | None = None,
) -> tuple[torch.Tensor, int, float, int]:  # fmt: skip
    """(summed gradient, targets, objective, clipped executions) of one batch, no update."""
    if not steps or info.num_executions == 0:
        raise TrainingError("empty batch: no micro-steps or no execution contributes targets")
    owner = list(assignment) if assignment is not None else [0] * len(steps)
    if len(owner) != len(steps) or not all(0 <= c < len(cells) for c in owner):
        raise TrainingError(f"assignment: {owner!r} must name a cell 0..{len(cells) - 1} per step")
    sums = merge_sums([cells[c].prepass(s) for s, c in zip(steps, owner)])
    scalars = execution_scalars(sums, info.executions, objective)
    for cell in cells:
        cell.zero_grad()
    done = [cells[c].accumulate(s, scalars) for s, c in zip(steps, owner)]
    total = cells[0].flat_grads.clone()
    for cell in cells[1:]:
        total += cell.flat_grads
    clipped = sum(1 for s in scalars.values() if s.gate == 0.0)
    return total, sum(d.targets for d in done), sum(d.objective for d in done), clipped


def train_batch_reference(
    cells: Sequence[TorchCell], optimizer: CoreOptimizer, steps: Sequence[MicroStep],
    info: BatchInfo, *, objective: ObjectiveConfig, assignment: Sequence[int] | None = None,
) -> BatchStats:  # fmt: skip
    """One batch and one core update; cells[0] is the core, the others get its weights."""
    total, targets, value, clipped = batch_gradient_sum(
        cells, steps, info, objective=objective, assignment=assignment
    )
    norm = optimizer.step(batch_gradient(total, info.num_executions))
    for cell in cells:
        cell.zero_grad()
        if cell is not cells[0]:
            cell.load_params(cells[0].flat_params)
    return BatchStats(targets=targets, objective=value, clipped_executions=clipped,
                      grad_norm=norm, grad_sum=total)  # fmt: skip
