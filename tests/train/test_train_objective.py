"""The execution-level objective against slow per-token references, and split invariance;
chunked target log-probs against plain log-softmax + gather, with a check that no
full-vocabulary temporary comes back."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import train_batch_reference
from torch.utils._python_dispatch import TorchDispatchMode

from gyre.errors import TrainingError
from gyre.train.cell import CoreOptimizer, OptimConfig, TorchCell
from gyre.train.objective import (
    ObjectiveConfig,
    execution_scalars,
    lm_head_target_logprobs,
    merge_sums,
    ratio_sums,
    step_loss,
    step_tensors,
    target_logprobs,
    token_coefficients,
)
from gyre.train.packing import MicroStep, pack_rows
from gyre.train.synthetic import random_batch


def _inputs(seed: int, spread: float):
    rng = np.random.default_rng(seed)
    rows, info = random_batch(rng, executions=6, vocab=50, behaviour_noise=0.05)
    step = MicroStep(index=0, rows=tuple(rows))
    st_ = step_tensors(step)
    logp = st_.behaviour + spread * torch.randn(
        st_.behaviour.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    return rows, info, st_, logp.clone().requires_grad_(True)  # fmt: skip


def _fast_grad(logp, st_, info, cfg):
    sums = ratio_sums(logp, st_)
    sc = execution_scalars(sums, info.executions, cfg)
    coeff = token_coefficients(logp, st_, sc, cfg)
    (g,) = torch.autograd.grad(step_loss(logp, coeff), logp)
    return -g / info.num_executions, sc


def _reference_grad(rows, logp, info, cfg, mode: str) -> torch.Tensor:
    """Per token, from the definitions (GSPO's min/clip on the execution's sequence ratio)."""
    E = len(info.executions)
    total = torch.zeros((), dtype=torch.float64)
    for eid, (adv, n) in info.executions.items():
        toks = [
            (k, t)
            for k, r in enumerate(rows)
            if r.execution_id == eid
            for t in range(r.length)
            if r.targets[t]
        ]
        d = [logp[k, t] - float(rows[k].behaviour_logprobs[t]) for k, t in toks]
        s = torch.exp(sum(d) / n)  # sequence ratio: every admitted target of the execution
        if mode == "sequence_ratio":  # literal GSPO with execution-level sequences
            total = (
                total
                + torch.minimum(s * adv, torch.clamp(s, cfg.clip_low, cfg.clip_high) * adv) / E
            )
            continue
        sv = float(s.detach())
        clipped = (adv > 0 and sv > cfg.clip_high) or (adv < 0 and sv < cfg.clip_low)
        for di, (k, t) in zip(d, toks):
            r = math.exp(float(di.detach()))
            tok = torch.exp(di) if r <= cfg.token_weight_cap else cfg.token_weight_cap * logp[k, t]
            total = total + (0.0 if clipped else 1.0) * adv * tok / (n * E)
    (g,) = torch.autograd.grad(total, logp)
    return g  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", ["capped_token_ratio", "sequence_ratio"])
def test_gradient_matches_per_token_reference(seed: int, mode: str) -> None:
    spread = [0.003, 0.02, 1.0, 3.0][seed % 4]  # near/behind the clip bounds, over the cap
    rows, info, st_, logp = _inputs(seed, spread)
    cfg = ObjectiveConfig(token_weight=mode)
    fast, sc = _fast_grad(logp, st_, info, cfg)
    ref = _reference_grad(rows, logp, info, cfg, mode)
    assert torch.allclose(fast, ref, rtol=1e-10, atol=1e-13)
    if seed % 4 == 0:
        assert any(s.gate == 1 for s in sc.values())


def test_clipping_and_cap_are_active_somewhere() -> None:
    _rows, info, st_, logp = _inputs(3, 3.0)
    _, sc = _fast_grad(logp, st_, info, ObjectiveConfig())
    assert any(s.gate == 0 for s in sc.values())
    assert ((logp - st_.behaviour)[st_.targets] > math.log(5)).any()


def _split(rows, cut_points, order):
    steps, start = [], 0
    for k, cut in enumerate([*cut_points, len(rows)]):
        steps.append(MicroStep(index=k, rows=tuple(rows[i] for i in order[start:cut])))
        start = cut
    return [s for s in steps if s.rows]


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 3), st.data())
def test_gradient_and_update_independent_of_split_and_cells(
    tiny64_base, seed, ncells, data
) -> None:
    rng = np.random.default_rng(seed)
    rows, info = random_batch(rng, executions=5, vocab=4096, length=(6, 20), behaviour_noise=0.01)
    cfg = ObjectiveConfig()
    opt_cfg = OptimConfig(lr=1e-3)

    def run(steps, owners, n):
        cells = [TorchCell(copy.deepcopy(tiny64_base), objective=cfg) for _ in range(n)]
        opt = CoreOptimizer(cells[0], opt_cfg)
        stats = train_batch_reference(cells, opt, steps, info, objective=cfg, assignment=owners)
        return stats.grad_sum, cells[0].flat_params.clone(), cells[-1].flat_params.clone()

    g_ref, p_ref, _ = run([MicroStep(index=0, rows=tuple(rows))], [0], 1)
    order = data.draw(st.permutations(range(len(rows))))
    cuts = sorted(
        data.draw(st.lists(st.integers(1, len(rows) - 1), max_size=len(rows) - 1, unique=True))
    )
    steps = _split(rows, cuts, order)
    owners = data.draw(
        st.lists(st.integers(0, ncells - 1), min_size=len(steps), max_size=len(steps))
    )
    g, p, p_last = run(steps, owners, ncells)
    # every execution may be clipped out (gate 0): then both gradients must be exactly zero
    assert float((g - g_ref).norm()) <= 1e-6 * max(float(g_ref.norm()), 1e-30)
    assert float((p - p_ref).norm()) <= 1e-6 * float(p_ref.norm())
    assert torch.equal(p, p_last)  # satellites receive the updated weights  # fmt: skip


def test_nan_current_logprobs_and_empty_batch_are_errors(tiny64) -> None:
    rows, info = random_batch(np.random.default_rng(0), executions=2, vocab=4096)
    cell = TorchCell(tiny64, objective=ObjectiveConfig())
    opt = CoreOptimizer(cell, OptimConfig())
    with pytest.raises(TrainingError, match="empty batch"):
        train_batch_reference([cell], opt, [], info, objective=ObjectiveConfig())
    cell.flat_params[:100] = float("nan")  # a poisoned embedding row set
    steps = pack_rows(rows, token_budget=10_000)
    with pytest.raises(TrainingError, match="not finite"):
        train_batch_reference([cell], opt, steps, info, objective=ObjectiveConfig())
    assert opt.steps == 0 and torch.equal(cell.flat_grads, torch.zeros_like(cell.flat_grads))


def test_missing_execution_sums_are_an_error() -> None:
    with pytest.raises(TrainingError, match="no log-ratio sums"):
        execution_scalars(
            merge_sums([{"a": 0.1}]), {"a": (1.0, 3), "b": (0.5, 2)}, ObjectiveConfig()
        )


# ---- target log-probs: chunked vs the obvious full log-softmax --------------------------------


def _reference_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slow, obvious definition (and the code before chunking): log_softmax, then gather."""
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
    return torch.nn.functional.pad(picked.squeeze(-1), (1, 0))


def _values_and_grad(fn, logits: torch.Tensor, ids, weights):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, ids)
    (out.to(weights.dtype) * weights).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 12),
    vocab=st.integers(1, 40),
    chunk=st.one_of(st.none(), st.integers(1, 20)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    scale=st.sampled_from([0.1, 3.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_target_logprobs_match_log_softmax(rows, width, vocab, chunk, dtype, scale, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(rows, width, vocab, generator=gen, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    weights = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    got, g_got = _values_and_grad(
        lambda x, i: target_logprobs(x, i, chunk_tokens=chunk), logits, ids, weights
    )
    want, g_want = _values_and_grad(_reference_logprobs, logits, ids, weights)
    assert got.dtype == dtype and got.shape == (rows, width) and g_got.dtype == dtype
    assert torch.equal(got[:, 0], torch.zeros(rows, dtype=dtype))
    tol = TOL[dtype]
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    assert torch.allclose(g_got, g_want, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk", [1, 5, None])
def test_bfloat16_logits_give_float32_logprobs(chunk) -> None:
    """16-bit logits: float32 log-probs (computed in float32 and not rounded back: a bf16
    log-prob would be off by up to 2^-9 of itself, wider than GSPO's clip window), equal to
    the float32 reference on the same logits; the logits' gradient is bfloat16, rounded once
    (within one bfloat16 step, 2^-7 relative, of the float32 reference's)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 17, 300, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 300, (3, 17), generator=gen)
    weights = torch.randn(3, 17, generator=gen)
    got, g_got = _values_and_grad(
        lambda x, i: target_logprobs(x, i, chunk_tokens=chunk), logits, ids, weights
    )
    want, g_want = _values_and_grad(_reference_logprobs, logits.float(), ids, weights)
    assert got.dtype == torch.float32 and g_got.dtype == torch.bfloat16
    step = 2.0**-7
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(g_got.float(), g_want, rtol=step, atol=step * float(g_want.abs().max()))
    old, _ = _values_and_grad(_reference_logprobs, logits, ids, weights)  # bf16 log_softmax
    assert torch.allclose(old.float(), got, rtol=2 * step, atol=1e-6)  # only rounding apart


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 10),
    chunk=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_lm_head_logprobs_match_logits_path(rows, width, chunk, seed) -> None:
    """From hidden states and the head weight: the same values and both gradients."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 30, (rows, width), generator=gen)
    coeff = torch.randn(rows, width, generator=gen, dtype=torch.float64)

    def run(fn):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fn(h, w)
        step_loss(out, coeff).backward()
        return out.detach(), h.grad, w.grad

    got = run(lambda h, w: lm_head_target_logprobs(h, w, ids, chunk_tokens=chunk))
    want = run(lambda h, w: _reference_logprobs(h @ w.T, ids))
    for a, b in zip(got, want):
        assert a is not None and b is not None
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_lm_head_logprobs_bfloat16_accumulates_head_gradient_in_float32() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 40, 16, generator=gen).to(torch.bfloat16)
    weight = (0.3 * torch.randn(200, 16, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 200, (2, 40), generator=gen)
    coeff = torch.randn(2, 40, generator=gen, dtype=torch.float64)
    w = weight.clone().requires_grad_(True)
    out = lm_head_target_logprobs(hidden, w, ids, chunk_tokens=4)
    step_loss(out, coeff).backward()
    w32 = weight.float().requires_grad_(True)
    step_loss(_reference_logprobs(hidden.float() @ w32.T, ids), coeff).backward()
    assert out.dtype == torch.float32 and w.grad is not None and w.grad.dtype == torch.bfloat16
    assert w32.grad is not None
    err = float((w.grad.float() - w32.grad).norm() / w32.grad.norm())
    assert err < 2.0**-8  # one rounding of the sum, not one per chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_full_vocabulary_temporary(dtype: torch.dtype) -> None:
    """Forward + backward of the step loss through `target_logprobs` allocates one full-size
    tensor besides the logits: their gradient. Every op's output is seen by a dispatch mode
    (backward included) and every tensor saved for backward by a saved-tensors hook; the
    plain log-softmax (4 full-size buffers, one saved) fails both checks."""
    rows, width, vocab = 2, 64, 500
    full = rows * (width - 1) * vocab
    logits = torch.randn(rows, width, vocab).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (rows, width))
    coeff = torch.randn(rows, width, dtype=torch.float64)
    big, saved = _FullSizeOutputs(full * logits.element_size() // 2), set[int]()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() >= full // 2:
            saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), big:
        step_loss(target_logprobs(logits, ids, chunk_tokens=rows * 8), coeff).backward()
    own = logits.untyped_storage().data_ptr()
    assert logits.grad is not None
    assert saved <= {own}, "a full-size tensor other than the logits is saved for backward"
    assert big.storages - {own} == {logits.grad.untyped_storage().data_ptr()}


class _FullSizeOutputs(TorchDispatchMode):
    """The storages of every op output of at least `nbytes` bytes."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.storages = nbytes, set[int]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.nbytes:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("source", ["ObjectiveConfig()", "the default run config"])
def test_default_clip_bounds_and_is_cap_are_the_papers(source: str) -> None:
    """A run that sets nothing trains with the paper's IS cap 5 and clip [0.995, 1.005]:
    checked by behaviour (the gate and the token weight), not by reading the fields back."""
    if source == "ObjectiveConfig()":
        cfg = ObjectiveConfig()
    else:
        from gyre.runtime.shared.config import DEFAULT_CONFIG, load_run_config

        cfg = load_run_config(DEFAULT_CONFIG).train.objective
    from gyre.train.objective import execution_gate

    for adv, inside, outside in [(1.0, 1.0049, 1.0051), (-1.0, 0.9951, 0.9949), (1.0, 0.5, 1.01)]:
        assert execution_gate(adv, math.log(inside), cfg) == 1.0, (adv, inside)
        assert execution_gate(adv, math.log(outside), cfg) == 0.0, (adv, outside)
    # the token weight: exp(d) below 5, exactly 5 above, on an execution whose gate is open
    _rows, info, st_, logp = _inputs(3, 3.0)
    sums = ratio_sums(logp, st_)
    sc = execution_scalars(sums, info.executions, cfg)
    coeff = token_coefficients(logp, st_, sc, cfg)
    per_row = torch.tensor([sc[e].gate * sc[e].advantage / sc[e].num_targets
                            for e in st_.executions], dtype=torch.float64)  # fmt: skip
    live = st_.targets & (per_row != 0)[:, None]
    rho = coeff[live] / per_row[:, None].expand_as(coeff)[live]
    d = (logp.detach() - st_.behaviour)[live]
    assert (d > math.log(5.0)).any() and (d < math.log(5.0)).any()
    assert torch.allclose(rho, torch.exp(d).clamp(max=5.0), rtol=1e-12)
