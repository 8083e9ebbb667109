"""A torch training cell: forward passes, gradient accumulation and (on the core) the update.

`TorchCell` wraps a causal LM whose parameters and gradients it re-homes into two flat,
contiguous buffers (`flat_params`, `flat_grads`), so a weight snapshot is one memory region
(registered once with Mooncake or exposed to MPI) and a gradient reduction is one collective.

Per batch (see docs/training.md):

* phase A — `prepass(step)`: a no-grad forward returning per-execution sums of
  (log pi_theta - behaviour log-prob) over the step's targets;
* phase B — `accumulate(step, scalars)`: forward + backward of the step's loss; gradients add
  up in `flat_grads` (without the batch factor 1/E, applied once to the sum);
* core only — `CoreOptimizer.step(grad)`: clip at `grad_clip` norm, one AdamW step.

Works on CPU and GPU (`device`); the dtype is the model's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gyre.errors import TrainingError
from gyre.train.config import ObjectiveConfig, OptimConfig
from gyre.train.objective import (
    ExecutionScalar,
    check_finite,
    ratio_sums,
    step_loss,
    step_tensors,
    target_logprobs,
    token_coefficients,
)
from gyre.train.packing import MicroStep


@dataclass(slots=True)
class StepStats:
    """What one phase-B micro-step reports."""

    targets: int
    objective: float  # sum of c_t: this step's share of E * J at the current point


def _logits(model: Any, st: Any) -> torch.Tensor:
    out = model(input_ids=st.ids, attention_mask=st.attention)
    return out.logits if hasattr(out, "logits") else out


def flatten_parameters(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every parameter (and its grad) into views of two flat buffers; returns them."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainingError("model: has no trainable parameters")
    dtype, device = params[0].dtype, params[0].device
    total = sum(p.numel() for p in params)
    flat = torch.empty(total, dtype=dtype, device=device)
    grads = torch.zeros(total, dtype=dtype, device=device)
    off = 0
    for p in params:
        n = p.numel()
        flat[off : off + n].copy_(p.data.reshape(-1))
        p.data = flat[off : off + n].view_as(p)
        p.grad = grads[off : off + n].view_as(p)
        off += n
    return flat, grads


class TorchCell:
    """One training cell's actor replica (single rank)."""

    def __init__(self, model: torch.nn.Module, *, objective: ObjectiveConfig) -> None:
        self.model = model
        self.objective = objective
        self.flat_params, self.flat_grads = flatten_parameters(model)
        self.device = self.flat_params.device

    def load_params(self, flat: torch.Tensor) -> None:
        """Overwrite the weights in place from a flat snapshot."""
        if flat.shape != self.flat_params.shape:
            raise TrainingError(f"snapshot: {tuple(flat.shape)} != {tuple(self.flat_params.shape)}")
        self.flat_params.copy_(flat)

    def zero_grad(self) -> None:
        """Start a new batch's gradient accumulation."""
        self.flat_grads.zero_()

    def free_scratch(self) -> None:
        """Drop the device scratch the passes allocate and keep for the next one (rebuilt at
        the next pass): when the trainer leaves its GPU (`TrainerResidency`). A plain torch
        model keeps none."""

    def _logprobs(self, step: MicroStep, *, grad: bool) -> tuple[torch.Tensor, Any]:
        st = step_tensors(step, self.device)
        with torch.set_grad_enabled(grad):
            logp = target_logprobs(_logits(self.model, st), st.ids)
        check_finite(logp, st, f"micro-step {step.index}")
        return logp, st

    def prepass(self, step: MicroStep) -> dict[str, float]:
        """Phase A: per-execution sums of the token log-ratio over this step's targets."""
        logp, st = self._logprobs(step, grad=False)
        return ratio_sums(logp, st)

    def accumulate(self, step: MicroStep, scalars: Mapping[str, ExecutionScalar]) -> StepStats:
        """Phase B: forward + backward; the gradient (without 1/E) adds into `flat_grads`."""
        logp, st = self._logprobs(step, grad=True)
        coeff = token_coefficients(logp, st, scalars, self.objective)
        self._backward(step_loss(logp, coeff))
        return StepStats(targets=int(st.targets.sum()), objective=float(coeff.sum()))

    def _backward(self, loss: torch.Tensor) -> None:
        """The micro-step's backward (a pipeline stage's differs: `MegatronCell`)."""
        loss.backward()


class CoreOptimizer:
    """The core cell's sole optimizer: AdamW over the flat parameter buffer."""

    def __init__(self, cell: TorchCell, config: OptimConfig) -> None:
        self.cell = cell
        self.config = config
        self._param = torch.nn.Parameter(cell.flat_params, requires_grad=True)
        self.opt = torch.optim.AdamW(
            [self._param],
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            foreach=False,
        )
        self.steps = 0

    def step(self, summed_grads: torch.Tensor) -> float:
        """Clip the batch gradient and apply one update in place; returns the pre-clip norm."""
        if not torch.isfinite(summed_grads).all():
            raise TrainingError("batch gradient is not finite; update skipped")
        grad = summed_grads.clone()
        norm = float(grad.norm())
        if self.config.grad_clip > 0 and norm > self.config.grad_clip:
            grad.mul_(self.config.grad_clip / (norm + 1e-6))
        self._param.grad = grad
        self.opt.step()
        self._param.grad = None
        self.steps += 1
        return norm if math.isfinite(norm) else float("nan")
