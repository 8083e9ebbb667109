"""The execution-level GSPO adaptation (derivation and definitions: docs/objective.md).

For execution i with admitted, deduplicated targets T_i (L_i = |T_i|), advantage A_i, behaviour
log-probs b_t (recorded by the rollout engine) and current log-probs l_t = log pi_theta:

    token log-ratio     d_t   = l_t - b_t
    sequence log-ratio  S_i   = (1 / L_i) * sum_{t in T_i} d_t        s_i = exp(S_i)
    execution gate      g_i   = 0 if (A_i > 0 and s_i > clip_high) or (A_i < 0 and s_i < clip_low)
                                else 1                                    (GSPO's min/clip)
    token weight        rho_t = min(exp(d_t), cap)  (held constant)       cap = 5
    gradient            grad J = (1/E) * sum_i (g_i * A_i / L_i) * sum_{t in T_i} rho_t * grad l_t

The loss a micro-step backpropagates is `-sum_t c_t * l_t` with the detached coefficient
`c_t = g_i * A_i * rho_t / L_i`; the core multiplies the batch's summed gradient by 1/E
(`batch_gradient`), since E is known only once the batch closes. g_i couples all rows of an execution, so it is computed
in a no-grad *prepass* over the whole batch first (phase A, `ratio_sums` per micro-step, summed
per execution), then every micro-step's backward (phase B) is independent: gradient sums are
the same for any split of rows into micro-steps and any assignment of micro-steps to cells.

`token_weight="sequence_ratio"` uses rho_t = s_i instead, which is exactly GSPO's gradient
(Zheng et al., 2025) with our execution-level sequences and normalization.

l_t comes from `target_logprobs(logits, ids)`, chunked over the sequence in forward and backward
so that no full-vocabulary log-softmax of a row exists (with a `VocabShard`, from a
tensor-parallel rank's vocabulary shard of the logits); `lm_head_target_logprobs(hidden,
lm_head_weight, ids)` also makes each chunk's logits inside the chunk, for rows whose logits
would not fit (docs/training.md, "Memory per token (measured)").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from gyre.errors import TrainingError
from gyre.train.config import ObjectiveConfig
from gyre.train.packing import MicroStep
from gyre.train.scalars import (  # torch-free (the coordinator's), re-exported here
    ExecutionScalar as ExecutionScalar,
)
from gyre.train.scalars import execution_gate as execution_gate
from gyre.train.scalars import execution_scalars as execution_scalars
from gyre.train.scalars import merge_sums as merge_sums


@dataclass(slots=True)
class StepTensors:
    """A micro-step as padded tensors."""

    ids: torch.Tensor  # int64 [n, T]
    attention: torch.Tensor  # int64 [n, T] (1 = real token)
    targets: torch.Tensor  # bool [n, T]
    behaviour: torch.Tensor  # float64 [n, T] (0 off-target)
    executions: list[str]  # execution id per row


def step_tensors(step: MicroStep, device: str | torch.device = "cpu") -> StepTensors:
    """Right-padded tensors of a micro-step."""
    if not step.rows:
        raise TrainingError(f"micro-step {step.index}: has no rows")
    n, width = len(step.rows), max(r.length for r in step.rows)
    ids = np.zeros((n, width), np.int64)
    att = np.zeros((n, width), np.int64)
    tgt = np.zeros((n, width), bool)
    beh = np.zeros((n, width), np.float64)
    for k, r in enumerate(step.rows):
        ids[k, : r.length], att[k, : r.length], tgt[k, : r.length] = r.ids, 1, r.targets
        beh[k, : r.length] = np.where(r.targets, r.behaviour_logprobs, 0.0)
    return StepTensors(
        ids=torch.from_numpy(ids).to(device),
        attention=torch.from_numpy(att).to(device),
        targets=torch.from_numpy(tgt).to(device),
        behaviour=torch.from_numpy(beh).to(device),
        executions=[r.execution_id for r in step.rows],
    )


CHUNK_ELEMENTS = 1 << 25
"""Logits per chunk of `target_logprobs` when no `chunk_tokens` is given (128 MiB in float32):
the bound on each per-chunk temporary, whatever the row length."""


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This rank's slice [start, start + size) of a vocabulary split over ranks (Megatron's
    vocab-parallel output layer: equal contiguous shards), and how per-position statistics
    are combined over those ranks: `reduce(t, op)` replaces `t` in place by its elementwise
    "max" or "sum" over the ranks (a collective; every rank calls it in the same order)."""

    start: int
    size: int
    reduce: Callable[[torch.Tensor, str], None]

    def local(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into this shard, clamped to 0 where another rank holds the id; whether
        this rank holds it)."""
        index = target - self.start
        held = (index >= 0) & (index < self.size)
        return index.masked_fill(~held, 0), held


def target_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    vocab_shard: VocabShard | None = None,
) -> torch.Tensor:
    """log pi(ids[:, t] | ids[:, :t]) for t >= 1 (column 0 is 0), in float32 for 16-bit
    logits (else the logits' dtype); the logits' gradient is in their own dtype.

    Computed `logits[target] - logsumexp(logits)` chunk by chunk over the sequence, forward and
    backward (which recomputes each chunk's softmax), so no full-vocabulary log-softmax, upcast
    copy or second gradient buffer of the `[rows, len, vocab]` logits is ever allocated; the
    only full-size tensor besides the logits is their own gradient. A chunk holds about
    `chunk_tokens` positions of all rows (default: `CHUNK_ELEMENTS // vocab`); the arithmetic
    is in float32 for 16-bit logits (float64 stays float64), and so is the result, as
    Megatron's cross-entropy returns float32 for bf16 logits: a log-prob rounded to bfloat16
    is off by up to 2^-9 of itself (0.01 at -5), twice the width of GSPO's 0.995..1.005 window
    on a token's ratio.

    With a `vocab_shard`, `logits` is this rank's `[rows, len, shard size]` slice of the
    vocabulary: each chunk's max, sum of exponentials and target logit are reduced over the
    ranks, so every rank gets the whole vocabulary's log-probs, and the backward (no
    reduction) gives the gradient of this rank's slice. Every rank calls it with the same
    `ids` and `chunk_tokens`.
    """
    chunk = _chunk_positions(logits.shape[0], logits.shape[-1], chunk_tokens)
    out = _TargetLogprobs.apply(logits, ids, chunk, vocab_shard)
    assert isinstance(out, torch.Tensor)
    return out


def lm_head_target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """`target_logprobs(hidden @ weight.T, ids)` without the logits tensor.

    `hidden` [rows, len, H] is the model's last hidden state (after its final norm) and
    `weight` [vocab, H] its bias-free LM head (`model.get_output_embeddings().weight`, tied
    or not); each chunk's logits are computed, used and dropped, in forward and again in
    backward, so memory per token is O(H), not O(vocab). Gradients flow to both `hidden` and
    `weight` (the head's gradient is accumulated over chunks in float32 for 16-bit weights);
    the result is float32 for 16-bit inputs, as `target_logprobs`'s is.
    """
    chunk = _chunk_positions(hidden.shape[0], weight.shape[0], chunk_tokens)
    out = _HeadTargetLogprobs.apply(hidden, weight, ids, chunk)
    assert isinstance(out, torch.Tensor)
    return out


def _chunk_positions(rows: int, vocab: int, chunk_tokens: int | None) -> int:
    """Sequence positions per chunk so that one chunk holds ~`chunk_tokens` rows x positions."""
    tokens = chunk_tokens if chunk_tokens is not None else CHUNK_ELEMENTS // max(vocab, 1)
    if tokens < 1:
        raise TrainingError(f"chunk_tokens: {chunk_tokens}; allowed >= 1")
    return max(1, tokens // max(rows, 1))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _spans(width: int, chunk: int) -> list[tuple[int, int]]:
    """[s, e) over the predicting positions 0 .. width-2 (position t predicts ids[:, t+1])."""
    return [(s, min(s + chunk, width - 1)) for s in range(0, width - 1, chunk)]


def _chunk_logprobs(
    z: torch.Tensor, ids: torch.Tensor, s: int, e: int, ct: torch.dtype,
    shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(target log-probs, max, log-sum-exp of logits - max) of the logits chunk `z` (positions
    s..e-1), in `ct`; the target's `logit - max` is taken before the log-sum is subtracted, as
    in log_softmax, so a target near probability 1 keeps its small log-prob. With a `shard`,
    max, sum and target logit are the whole vocabulary's (all-reduced)."""
    top = z.amax(dim=-1).to(ct)
    if shard is not None:
        shard.reduce(top, "max")
    shifted = torch.sub(z, top[..., None])  # the chunk's one temporary (in ct)
    total = shifted.exp_().sum(dim=-1)
    if shard is not None:
        shard.reduce(total, "sum")
    logsum = total.log_()
    target = ids[:, s + 1 : e + 1]
    if shard is None:
        picked = z.gather(-1, target[..., None]).squeeze(-1).to(ct)
    else:
        index, held = shard.local(target)
        picked = z.gather(-1, index[..., None]).squeeze(-1).to(ct).masked_fill_(~held, 0)
        shard.reduce(picked, "sum")  # the one rank holding the target gives its logit
    return (picked - top) - logsum, top, logsum


def _chunk_grad(
    z: torch.Tensor,
    ids: torch.Tensor,
    top: torch.Tensor,
    logsum: torch.Tensor,
    g: torch.Tensor,
    s: int,
    e: int,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """d/dz of sum g * log_softmax(z)[target] = g * (onehot(target) - softmax(z)), in the
    dtype of `top` (one chunk-sized temporary, updated in place); with a `shard`, of this
    rank's slice of the vocabulary (`top` and `logsum` are the whole vocabulary's)."""
    dz = torch.sub(z, top[..., None]).sub_(logsum[..., None]).exp_().mul_(-g[..., None])
    target = ids[:, s + 1 : e + 1]
    if shard is None:
        return dz.scatter_add_(-1, target[..., None], g[..., None])
    index, held = shard.local(target)
    return dz.scatter_add_(-1, index[..., None], g.masked_fill(~held, 0)[..., None])


class _TargetLogprobs(torch.autograd.Function):
    """`target_logprobs` from the logits, chunked over the sequence in forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, ids: torch.Tensor, chunk: int, shard: VocabShard | None
    ) -> torch.Tensor:
        n, width, _ = logits.shape
        ct = _compute_dtype(logits.dtype)
        out, top, logsum = torch.zeros((3, n, width), dtype=ct, device=logits.device).unbind(0)
        for s, e in _spans(width, chunk):
            col = slice(s + 1, e + 1)
            out[:, col], top[:, col], logsum[:, col] = _chunk_logprobs(
                logits[:, s:e], ids, s, e, ct, shard
            )
        ctx.save_for_backward(logits, ids, top, logsum)
        ctx.chunk, ctx.shard = chunk, shard
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, ids, top, logsum = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = torch.empty_like(logits)
        grad[:, -1].zero_()  # the last position predicts nothing
        for s, e in _spans(logits.shape[1], ctx.chunk):
            col = slice(s + 1, e + 1)
            g = grad_out[:, col].to(top.dtype)
            grad[:, s:e].copy_(
                _chunk_grad(logits[:, s:e], ids, top[:, col], logsum[:, col], g, s, e, ctx.shard)
            )
        return grad, None, None, None


class _HeadTargetLogprobs(torch.autograd.Function):
    """`lm_head_target_logprobs`: each chunk's logits recomputed from hidden states."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        n, width, _ = hidden.shape
        ct = _compute_dtype(hidden.dtype)
        out, top, logsum = torch.zeros((3, n, width), dtype=ct, device=hidden.device).unbind(0)
        for s, e in _spans(width, chunk):
            z = torch.nn.functional.linear(hidden[:, s:e], weight)
            col = slice(s + 1, e + 1)
            out[:, col], top[:, col], logsum[:, col] = _chunk_logprobs(z, ids, s, e, ct)
        ctx.save_for_backward(hidden, weight, ids, top, logsum)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, ids, top, logsum = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for s, e in _spans(hidden.shape[1], ctx.chunk):
            h = hidden[:, s:e]
            z = torch.nn.functional.linear(h, weight)
            col = slice(s + 1, e + 1)
            g = grad_out[:, col].to(top.dtype)
            dz = _chunk_grad(z, ids, top[:, col], logsum[:, col], g, s, e).to(hidden.dtype)
            del z
            if grad_h is not None:
                grad_h[:, s:e] = dz @ weight
            if grad_w is not None:
                grad_w += (dz.flatten(0, 1).T @ h.flatten(0, 1)).to(grad_w.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def check_finite(logp: torch.Tensor, st: StepTensors, where: str) -> None:
    """Raise `TrainingError` if the policy produced non-finite log-probs at a target."""
    if not torch.isfinite(logp[st.targets]).all():
        raise TrainingError(f"{where}: current-policy log-probs at targets are not finite")


def ratio_sums(logp: torch.Tensor, st: StepTensors) -> dict[str, float]:
    """Phase A: sum over this micro-step's targets of (l_t - b_t), per execution (float64)."""
    d = (logp.detach().double() - st.behaviour) * st.targets
    per_row = d.sum(dim=1).tolist()
    out: dict[str, float] = {}
    for eid, v in zip(st.executions, per_row):
        out[eid] = out.get(eid, 0.0) + v
    return out


def token_coefficients(
    logp: torch.Tensor,
    st: StepTensors,
    scalars: Mapping[str, ExecutionScalar],
    cfg: ObjectiveConfig,
) -> torch.Tensor:
    """Detached c_t = g_i A_i rho_t / L_i at targets, 0 elsewhere (float64 [n, T]).

    The batch factor 1/E is not in c_t: E is final only when the batch closes, so the core
    divides the summed gradient by E before clipping (`batch_gradient`).
    """
    rows = [scalars[e] for e in st.executions]
    dev = st.behaviour.device
    per_row = torch.tensor(
        [s.gate * s.advantage / s.num_targets for s in rows], dtype=torch.float64, device=dev
    )
    if cfg.token_weight == "sequence_ratio":
        rho = torch.tensor([math.exp(s.log_ratio) for s in rows], dtype=torch.float64, device=dev)
        rho = rho[:, None].expand_as(st.behaviour)
    else:
        d = logp.detach().double() - st.behaviour
        rho = torch.exp(d.clamp(max=math.log(cfg.token_weight_cap)))
    return torch.where(st.targets, per_row[:, None] * rho, torch.zeros_like(rho))


def batch_gradient(summed: torch.Tensor, num_executions: int) -> torch.Tensor:
    """grad J: the micro-steps' summed gradient times 1/E (a new tensor)."""
    if num_executions < 1:
        raise TrainingError(f"num_executions: {num_executions}; a batch needs >= 1 execution")
    return summed / num_executions


def step_loss(logp: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """The micro-step's loss: -sum c_t l_t (its gradient is -grad J restricted to the step)."""
    return -(coeff.to(logp.dtype) * logp).sum()
