"""A torch training cell: forward passes, gradient accumulation and (on the core) the update.

`TorchCell` wraps a causal LM whose parameters and gradients it re-homes into two flat,
contiguous buffers (`flat_params`, `flat_grads`), so a weight snapshot is one memory region
(registered once with Mooncake or exposed to MPI) and a gradient reduction is one collective.

Per batch (see docs/training.md):

* phase A — `prepass(step)`: a no-grad forward returning per-execution sums of
  (log pi_theta - behaviour log-prob) over the step's targets;
* phase B — `accumulate(step, scalars)`: forward + backward of the step's loss; gradients add
  up in `flat_grads` (without the batch factor 1/E, applied once to the sum);
* core only — `CoreOptimizer.step(grad, lr=...)`: clip at `grad_clip` norm, one AdamW step at
  the schedule's learning rate (`OptimConfig.lr_at`).

Works on CPU and GPU (`device`), in the model's dtype (`train.dtype`). A float32 model's
gradients add up in place: every parameter's `.grad` is a view of `flat_grads`. A bfloat16
model trains with Megatron's mixed precision (megatron-core's `Float16OptimizerWithFloat16Params`
over its DDP's float32 `main_grad` buffer; docs/training.md "Mixed precision"): `flat_grads`
is float32 and each parameter's bf16 gradient is added into it as soon as autograd has it
(a post-accumulate-grad hook; `.grad` is then dropped), and `CoreOptimizer` steps float32
*main weights* with float32 moments, then copies them, rounded, into the bf16 parameters.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gyre.errors import TrainingError
from gyre.rollout.routed import RouterTap
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
from gyre.train.packing import MicroStep, step_routing


@dataclass(slots=True)
class StepStats:
    """What one phase-B micro-step reports."""

    targets: int
    objective: float  # sum of c_t: this step's share of E * J at the current point


def _logits(model: Any, st: Any) -> torch.Tensor:
    out = model(input_ids=st.ids, attention_mask=st.attention)
    return out.logits if hasattr(out, "logits") else out


def main_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients add up in and the optimizer steps for parameters of `dtype`:
    float32 for 16-bit parameters (mixed precision), else the parameters' own."""
    return torch.promote_types(dtype, torch.float32)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's trainable parameters, in the order of the flat buffers."""
    return [p for p in model.parameters() if p.requires_grad]


def flatten_parameters(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every parameter into a view of one flat buffer, in `dtype` (None: the model's;
    rounded to nearest where narrower); returns it and the flat gradient buffer (zeros, in
    `main_dtype`). Buffers (RoPE's inverse frequencies) keep their dtype."""
    params = trainable(model)
    if not params:
        raise TrainingError("model: has no trainable parameters")
    dtype, device = dtype or params[0].dtype, params[0].device
    total = sum(p.numel() for p in params)
    flat = torch.empty(total, dtype=dtype, device=device)
    grads = torch.zeros(total, dtype=main_dtype(dtype), device=device)
    off = 0
    for p in params:
        n = p.numel()
        flat[off : off + n].copy_(p.data.reshape(-1))
        off += n
    view_parameters(model, flat, grads)
    return flat, grads


def view_parameters(model: torch.nn.Module, flat: torch.Tensor, grads: torch.Tensor) -> None:
    """Point every trainable parameter at its slice of `flat` and, where the two buffers share
    a dtype, its `.grad` at its slice of `grads` (a mixed-precision parameter's `.grad` is
    None between backwards: its cell adds it into `grads`). Where the buffers come from
    (`flatten_parameters`, or a residency move) the layout is this one."""
    same = flat.dtype == grads.dtype
    off = 0
    for p in trainable(model):
        n = p.numel()
        p.data = flat[off : off + n].view_as(p)
        p.grad = grads[off : off + n].view_as(p) if same else None
        off += n
    if off != flat.numel() or flat.shape != grads.shape:
        raise TrainingError(f"parameters cover {off} of {flat.numel()} flat elements")


class TorchCell:
    """One training cell's actor replica (single rank)."""

    def __init__(
        self, model: torch.nn.Module, *, objective: ObjectiveConfig,
        dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        """`model`'s parameters re-homed into the flat buffers, in `dtype` (None: their own;
        `train.params_dtype`); bfloat16 trains with mixed precision."""
        self.model = model
        self.objective = objective
        self.flat_params, self.flat_grads = flatten_parameters(model, dtype)
        self.device = self.flat_params.device
        # a transformers MoE model's routers, which replay the rows' recorded routing
        self._routers = RouterTap.of_model(model)
        if self.mixed:
            for p, off in zip(trainable(model), self._offsets(), strict=True):
                p.register_post_accumulate_grad_hook(self._adder(off, p.numel()))

    @property
    def mixed(self) -> bool:
        """Whether the parameters are 16-bit, their gradients added up in float32."""
        return self.flat_params.dtype != self.flat_grads.dtype

    def _offsets(self) -> list[int]:
        """Each trainable parameter's offset in the flat buffers."""
        sizes = [p.numel() for p in trainable(self.model)]
        return [0, *itertools.accumulate(sizes)][:-1]

    def _adder(self, off: int, n: int) -> Callable[[torch.Tensor], None]:
        """A mixed-precision parameter's hook: its new gradient into its float32 slice of
        `flat_grads` (looked up at each call: a residency move rebinds the buffer), then
        dropped, as Megatron's DDP adds `param.grad` into `param.main_grad`."""

        def add(p: torch.Tensor) -> None:
            assert p.grad is not None
            self.flat_grads[off : off + n].add_(p.grad.reshape(-1))
            p.grad = None

        return add

    def grad_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The gradient accumulated for trainable `param`: its view of `flat_grads`."""
        for p, off in zip(trainable(self.model), self._offsets(), strict=True):
            if p is param:
                return self.flat_grads[off : off + p.numel()].view_as(p)
        raise TrainingError("grad_of: not a trainable parameter of this cell's model")

    def load_params(self, flat: torch.Tensor) -> None:
        """Overwrite the weights in place from a flat snapshot."""
        if flat.shape != self.flat_params.shape:
            raise TrainingError(f"snapshot: {tuple(flat.shape)} != {tuple(self.flat_params.shape)}")
        self.flat_params.copy_(flat)

    def zero_grad(self) -> None:
        """Start a new batch's gradient accumulation."""
        self.flat_grads.zero_()
        if self.mixed:  # a backward that failed midway may have left 16-bit gradients
            for p in trainable(self.model):
                p.grad = None

    def free_scratch(self) -> None:
        """Drop the device scratch the passes allocate and keep for the next one (rebuilt at
        the next pass): when the trainer leaves its GPU (`TrainerResidency`). A plain torch
        model keeps none."""

    def _logprobs(self, step: MicroStep, *, grad: bool) -> tuple[torch.Tensor, Any]:
        st = step_tensors(step, self.device)
        routing = None
        if self._routers is not None:  # a MoE model: replay the rows' recorded routing
            routing = step_routing(step, st.ids.shape[1])
        with torch.set_grad_enabled(grad), self._replaying(routing):
            logp = target_logprobs(_logits(self.model, st), st.ids)
        check_finite(logp, st, f"micro-step {step.index}")
        return logp, st

    def _replaying(self, routing: Any) -> contextlib.AbstractContextManager[None]:
        if self._routers is None:
            return contextlib.nullcontext()
        return self._routers.replaying(routing)

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
        """The micro-step's backward."""
        loss.backward()

    def prepass_window(self, steps: Sequence[MicroStep]) -> list[dict[str, float]]:
        """A pass's window of micro-steps prepassed (`prepass` of each, in order; a
        pipeline's stages run them 1F1B: `MegatronCell`)."""
        return [self.prepass(step) for step in steps]

    def accumulate_window(
        self, steps: Sequence[MicroStep], scalars: Mapping[str, ExecutionScalar]
    ) -> list[StepStats]:
        """A pass's window of micro-steps accumulated (`accumulate` of each, in order)."""
        return [self.accumulate(step, scalars) for step in steps]


class CoreOptimizer:
    """The core cell's sole optimizer: AdamW over the flat parameter buffer, or over its
    float32 main weights where the cell's parameters are 16-bit (mixed precision)."""

    def __init__(self, cell: TorchCell, config: OptimConfig) -> None:
        self.cell = cell
        self.config = config
        main = cell.flat_params  # the weights AdamW steps: the flat buffer itself, or
        if cell.mixed:  # a float32 copy (Megatron's `fp32_from_float16_groups`) of it
            main = main.detach().to(cell.flat_grads.dtype, copy=True)
        self._param = torch.nn.Parameter(main, requires_grad=True)
        self.opt = torch.optim.AdamW(
            [self._param],
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            foreach=False,
        )
        self.steps = 0

    @property
    def main(self) -> torch.nn.Parameter:
        """The weights AdamW steps, float32 where the cell is mixed: the cell's flat buffer
        itself, or its main weights (what checkpoints keep)."""
        return self._param

    def global_norm(self, grads: torch.Tensor) -> float:
        """The L2 norm clipping uses (a model-parallel core's: over every shard)."""
        return float(grads.norm())

    def step(self, summed_grads: torch.Tensor, *, lr: float | None = None) -> float:
        """Clip the batch gradient and apply one update in place at learning rate `lr` (None:
        the config's `lr`; a run passes its schedule's, `OptimConfig.lr_at`); returns the
        pre-clip norm.

        The one mixed-precision step of both backends: `summed_grads` (the cell's float32
        `flat_grads` summed) clips and steps the main weights; a mixed cell's 16-bit
        parameters get the updated main weights, rounded to nearest, after the AdamW step."""
        for group in self.opt.param_groups:
            group["lr"] = self.config.lr if lr is None else lr
        grad = summed_grads.to(self._param.dtype, copy=True)
        norm = self.global_norm(grad)  # before the check: collective on a model-parallel core
        if not torch.isfinite(grad).all():
            raise TrainingError("batch gradient is not finite; update skipped")
        if self.config.grad_clip > 0 and norm > self.config.grad_clip:
            grad.mul_(self.config.grad_clip / (norm + 1e-6))
        self._param.grad = grad
        self.opt.step()
        self._param.grad = None
        if self.cell.mixed:
            self.cell.flat_params.copy_(self._param.detach())
        self.steps += 1
        return norm if math.isfinite(norm) else float("nan")

    def load_main(self, flat: torch.Tensor) -> None:
        """Set the main weights (a checkpoint's, float32, in the flat buffers' order); a mixed
        cell's parameters get them rounded."""
        with torch.no_grad():
            self._param.copy_(flat)
            if self.cell.mixed:
                self.cell.flat_params.copy_(self._param)
