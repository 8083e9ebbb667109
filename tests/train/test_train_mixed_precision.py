"""bf16 training (`train.dtype: bfloat16`): Megatron's mixed precision in the torch backend's
cell and the core's optimizer, checked on CPU against float32 (the Megatron backend's:
tests/gpu/test_gpu_megatron_mixed.py).

Mixed precision, as megatron-core's `Float16OptimizerWithFloat16Params` over its DDP's float32
`main_grad` buffer: bf16 parameters, gradients added up in float32, float32 main weights and
AdamW moments, the parameters the main weights rounded after every update; checkpoints keep
the float32 state, so a resume continues bit for bit. `train.dtype: float32` is plain torch
training, bit for bit as before.

Tolerances (bf16 against float32). bfloat16 keeps 8 significant bits (7 stored, 1 implicit),
so one rounding to nearest is off by at most u = 2^-8 of the value. A pass stores a bf16
result at each of n steps on its path; independent roundings add in quadrature, so a result
is off by about sqrt(n) u of its scale (the probabilistic rounding-error model: Higham and
Mary, SIAM J. Sci. Comput. 41(5), 2019); we allow T(n) = 2 sqrt(n) u. The forward of a
Qwen2 layer stores 16 results (input norm, q, k, v, rotated q and k, attention, o_proj,
residual, norm, gate, up, activation, product, down, residual), plus the rounded weights,
the final norm and the logits: n_f = 16 L + 3 (35 for the tiny model's two layers, T = 12 u
= 4.6 %); a backward as many again, n_b = 2 n_f (T = 17 u = 6.5 %). Compared:

* target log-probs: a log-prob is a logit minus the logits' log-sum-exp (in float32), so it
  carries the logits' absolute error: rms error <= T(n_f) rms(logits) (measured 3.3-3.8 u x rms(logits));
* the objective's value E J = sum_t c_t, each c_t proportional to exp(l_t - b_t), so it moves
  by its log-prob's error: |error| <= T(n_f) rms(logits) sum_t |c_t|;
* the batch gradient: relative L2 error <= T(n_b) (measured 4.8-5.4 u);
* one update, by what it does: the change it makes to the batch's target log-probs (evaluated
  in float32), relative L2 error <= T(n_b) (measured 3.0-3.4 u). Not the weight vector itself:
  AdamW normalises every coordinate, so a coordinate whose gradient lies within its rounding
  error of zero steps either way in either precision (a first step is lr * sign(g)); such
  coordinates carry almost none of the log-probs' sensitivity, so the update's effect
  inherits the gradient's error while its weight vector need not (from fresh moments the
  two differ by 12 %, their effects by 1.4 %).

The gates of GSPO's clipping are step functions of the sequence log-ratio: a ratio within
bf16's error of a clip bound may be gated in one precision and not the other. The comparison
runs with a wide clip window (0.8, 1.25) so that no gate changes and the tolerances above
apply; the learning run (docs/training.md "Mixed precision") runs the paper's window.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.errors import ConfigError
from gyre.train.cell import CoreOptimizer, TorchCell, _logits, trainable
from gyre.train.config import ObjectiveConfig, OptimConfig, ParallelDims, TrainConfig
from gyre.train.objective import (
    batch_gradient,
    execution_scalars,
    merge_sums,
    step_loss,
    step_tensors,
    target_logprobs,
    token_coefficients,
)
from gyre.train.packing import MicroStep, pack_rows
from gyre.train.stream import BatchInfo
from gyre.train.synthetic import random_batch

U = 2.0**-8
"""bfloat16's unit roundoff: 8 significant bits, rounded to nearest."""
WIDE = ObjectiveConfig(clip_low=0.8, clip_high=1.25)
"""A clip window no bf16 error moves a gate across (see the module's docstring)."""


def tolerance(roundings: int) -> float:
    """T(n) = 2 sqrt(n) u: n independent bf16 roundings, with a margin of 2."""
    return 2 * math.sqrt(roundings) * U


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    from gyre.models import load_model

    return load_model("tiny")[0].train()


def _forward_roundings(model: torch.nn.Module) -> int:
    return 16 * int(model.config.num_hidden_layers) + 3  # type: ignore[union-attr]


def _batch(model: torch.nn.Module, seed: int) -> tuple[list[MicroStep], BatchInfo]:
    """Micro-steps whose behaviour log-probs are the float32 model's own (ratios near 1)."""
    rows, info = random_batch(np.random.default_rng(seed), executions=6,
                              vocab=model.config.vocab_size, length=(16, 64))  # type: ignore[union-attr]  # fmt: skip
    cell = TorchCell(copy.deepcopy(model), objective=WIDE)
    logp, _ = cell._logprobs(MicroStep(index=0, rows=tuple(rows)), grad=False)
    rows = [dataclasses.replace(r, behaviour_logprobs=np.where(
                r.targets, logp[k, : r.length].double().numpy(), np.nan))
            for k, r in enumerate(rows)]  # fmt: skip
    return pack_rows(rows, token_budget=400), info


def _gradient(cell: TorchCell, steps: list[MicroStep], info: BatchInfo) -> tuple[float, float]:
    """Both phases of a batch into `cell.flat_grads`; (E J, sum_t |c_t|)."""
    sums = merge_sums([cell.prepass(s) for s in steps])
    scalars = execution_scalars(sums, info.executions, cell.objective)
    cell.zero_grad()
    value = sum(cell.accumulate(s, scalars).objective for s in steps)
    scale = 0.0
    for s in steps:
        logp, st = cell._logprobs(s, grad=False)
        scale += float(token_coefficients(logp, st, scalars, cell.objective).abs().sum())
    return value, scale


def _target_logprobs(model: torch.nn.Module, main: torch.Tensor, steps: list[MicroStep]):
    """The batch's target log-probs of the float32 model holding weights `main`."""
    cell = TorchCell(copy.deepcopy(model), objective=WIDE)
    cell.load_params(main)
    out = []
    for s in steps:
        logp, st = cell._logprobs(s, grad=False)
        out.append(logp[st.targets])
    return torch.cat(out)


# ---- train.dtype ----------------------------------------------------------------------------


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu() -> None:
    assert TrainConfig().params_dtype == "float32"
    assert TrainConfig(device="cuda").params_dtype == "bfloat16"
    assert TrainConfig(device="cuda:1").params_dtype == "bfloat16"
    assert TrainConfig(device="cuda", dtype="float32").params_dtype == "float32"
    assert TrainConfig(dtype="bfloat16").params_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype: 'float16'; allowed auto, float32, bfloat16"):
        TrainConfig(dtype="float16")  # type: ignore[arg-type]


# ---- float32: plain torch training, bit for bit --------------------------------------------


def test_float32_is_plain_torch_training_bit_for_bit(tiny: torch.nn.Module) -> None:
    """The float32 cell and core optimizer are plain torch: autograd accumulating into each
    parameter's own `.grad`, the flat gradient clipped, AdamW over the flat weights — the
    same bits (no main-weight copy, no hooks: every `.grad` a view of `flat_grads`)."""
    steps, info = _batch(tiny, 0)
    cfg = OptimConfig(lr=1e-3, grad_clip=0.5)
    cell = TorchCell(copy.deepcopy(tiny), objective=WIDE, dtype=torch.float32)
    opt = CoreOptimizer(cell, cfg)
    assert opt.main.data_ptr() == cell.flat_params.data_ptr() and not cell.mixed
    for p, g in zip(trainable(cell.model), _views(cell.flat_grads, cell.model), strict=True):
        assert p.grad is not None and p.grad.data_ptr() == g.data_ptr()
    _gradient(cell, steps, info)
    norm = opt.step(batch_gradient(cell.flat_grads, info.num_executions))

    ref = copy.deepcopy(tiny)  # the obvious loop, no flat buffers
    sums = merge_sums([_ref_pass(ref, s, None, None) for s in steps])
    scalars = execution_scalars(sums, info.executions, WIDE)
    for s in steps:
        _ref_pass(ref, s, scalars, WIDE)
    grad = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]) / info.num_executions
    assert torch.equal(cell.flat_grads / info.num_executions, grad)
    ref_norm = float(grad.norm())
    grad.mul_(cfg.grad_clip / (ref_norm + 1e-6))
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in ref.parameters()]))
    adamw = torch.optim.AdamW([flat], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              weight_decay=cfg.weight_decay, foreach=False)  # fmt: skip
    flat.grad = grad
    adamw.step()
    assert norm == ref_norm > cfg.grad_clip
    assert torch.equal(cell.flat_params, flat.detach())


def _ref_pass(model, step, scalars, objective):
    """Phase A (scalars None: the ratio sums) or phase B (backward into `.grad`) by hand."""
    from gyre.train.objective import ratio_sums

    st = step_tensors(step)
    with torch.set_grad_enabled(scalars is not None):
        logp = target_logprobs(model(input_ids=st.ids, attention_mask=st.attention).logits,
                               st.ids)  # fmt: skip
    if scalars is None:
        return ratio_sums(logp, st)
    step_loss(logp, token_coefficients(logp, st, scalars, objective)).backward()
    return None


def _views(flat: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    out, off = [], 0
    for p in trainable(model):
        out.append(flat[off : off + p.numel()])
        off += p.numel()
    return out


# ---- bfloat16: the mixed-precision state ----------------------------------------------------


def test_bfloat16_adds_gradients_in_float32_and_steps_float32_main_weights(
    tiny: torch.nn.Module,
) -> None:
    """bf16 parameters; each micro-step's bf16 gradient added into float32 `flat_grads` (the
    float32 sum of the steps' own gradients, not a bf16 running sum); AdamW over float32 main
    weights with float32 moments, exactly a float32 AdamW step; the parameters are the main
    weights rounded."""
    steps, info = _batch(tiny, 1)
    assert len(steps) >= 2
    cfg = OptimConfig(lr=1e-3)
    cell = TorchCell(copy.deepcopy(tiny), objective=WIDE, dtype=torch.bfloat16)
    opt = CoreOptimizer(cell, cfg)
    assert cell.mixed and cell.flat_params.dtype == torch.bfloat16
    assert cell.flat_grads.dtype == opt.main.dtype == torch.float32
    assert torch.equal(opt.main.detach(), cell.flat_params.float())  # made from the model's
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in trainable(cell.model))
    scalars = execution_scalars(merge_sums([cell.prepass(s) for s in steps]), info.executions,
                                WIDE)  # fmt: skip
    each = []
    for s in steps:  # every micro-step's own bf16 gradient, from zero
        cell.zero_grad()
        cell.accumulate(s, scalars)
        each.append(cell.flat_grads.clone())
        assert torch.equal(cell.flat_grads, cell.flat_grads.bfloat16().float())  # one bf16 grad
    cell.zero_grad()
    for s in steps:
        cell.accumulate(s, scalars)
    assert all(p.grad is None for p in trainable(cell.model))  # added, then dropped
    assert torch.equal(cell.flat_grads, sum(each[1:], each[0].clone()))
    grad = batch_gradient(cell.flat_grads, info.num_executions)

    main = torch.nn.Parameter(opt.main.detach().clone())  # float32 AdamW, by hand
    ref = torch.optim.AdamW([main], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)  # fmt: skip
    norm = float(grad.norm())
    main.grad = grad * (cfg.grad_clip / (norm + 1e-6)) if norm > cfg.grad_clip else grad.clone()
    ref.step()
    assert opt.step(grad) == norm
    assert torch.equal(opt.main.detach(), main.detach())
    assert torch.equal(cell.flat_params, main.detach().bfloat16())  # rounded to nearest
    state = opt.opt.state[opt.main]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(state["exp_avg_sq"], ref.state[main]["exp_avg_sq"])


# ---- bfloat16 against float32 ----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_objective_and_update_agree_with_float32(tiny: torch.nn.Module, seed: int) -> None:
    """Within T(n) of the module's docstring: log-probs, the objective, the batch gradient,
    and what one update (AdamW from three shared float32 updates) does to the log-probs."""
    n_f = _forward_roundings(tiny)
    warm = TorchCell(copy.deepcopy(tiny), objective=WIDE)
    warm_opt = CoreOptimizer(warm, OptimConfig(lr=1e-3))
    for k in range(3):  # moments of a shared history: the update depends on them smoothly
        steps, info = _batch(tiny, 100 + k)
        _gradient(warm, steps, info)
        warm_opt.step(batch_gradient(warm.flat_grads, info.num_executions))
    cells = {}
    for dtype in (torch.float32, torch.bfloat16):
        cell = TorchCell(copy.deepcopy(warm.model), objective=WIDE, dtype=dtype)
        opt = CoreOptimizer(cell, OptimConfig(lr=1e-3))
        opt.opt.load_state_dict(copy.deepcopy(warm_opt.opt.state_dict()))
        opt.load_main(warm_opt.main.detach())
        cells[dtype] = (cell, opt)
    (c32, o32), (c16, o16) = cells[torch.float32], cells[torch.bfloat16]
    steps, info = _batch(warm.model, seed)

    st = step_tensors(steps[0])
    with torch.no_grad():
        z = _logits(c32.model, st).float()
    scale = float(z.square().mean().sqrt())
    l32, l16 = (c._logprobs(steps[0], grad=False)[0][st.targets] for c in (c32, c16))
    assert l16.dtype == torch.float32  # log-probs of bf16 logits are not rounded to bf16
    assert float((l16 - l32).square().mean().sqrt()) <= tolerance(n_f) * scale

    j32, abs32 = _gradient(c32, steps, info)
    j16, _ = _gradient(c16, steps, info)
    assert abs(j16 - j32) <= tolerance(n_f) * scale * abs32
    g32, g16 = c32.flat_grads.clone(), c16.flat_grads.clone()
    assert float((g16 - g32).norm()) <= tolerance(2 * n_f) * float(g32.norm())

    before = o32.main.detach().clone()
    assert torch.equal(before, o16.main.detach())
    o32.step(batch_gradient(g32, info.num_executions))
    o16.step(batch_gradient(g16, info.num_executions))
    start = _target_logprobs(warm.model, before, steps)
    moved32 = _target_logprobs(warm.model, o32.main.detach(), steps) - start
    moved16 = _target_logprobs(warm.model, o16.main.detach(), steps) - start
    assert float(moved32.norm()) > 0
    assert float((moved16 - moved32).norm()) <= tolerance(2 * n_f) * float(moved32.norm())


# ---- checkpoints: float32 state, exact resume -----------------------------------------------


def _replica(dtype: str):
    from gyre.train.backends import backend

    train = TrainConfig(dtype=dtype, lr=1e-3)  # type: ignore[arg-type]
    return backend("torch").build("tiny", train, ParallelDims(tensor=1, pipeline=1, data=1),
                                  core=True, device="cpu")  # fmt: skip


def _update(replica, steps: list[MicroStep], info: BatchInfo) -> None:
    _gradient(replica.cell, steps, info)
    replica.optimizer.step(batch_gradient(replica.cell.flat_grads, info.num_executions))


def test_a_bfloat16_checkpoint_keeps_float32_state_and_resumes_exactly(
    tiny: torch.nn.Module, tmp_path: Path
) -> None:
    """Engines get bf16 weights; the checkpoint holds the float32 main weights and moments; a
    replica restored from it continues bit for bit as the one that never stopped, and a
    float32 replica resumes from it with exactly its main weights."""
    from gyre.train import core_file

    run = _replica("bfloat16")
    first, info = _batch(tiny, 0)
    _update(run, first, info)
    assert {t.dtype for _, t in run.named()} == {torch.bfloat16}  # what engines load
    run.save(tmp_path, version=1, shard=0)
    data = core_file.load(tmp_path)
    assert {t.dtype for _, t in data["named"]} == {torch.float32}
    flat = torch.cat([t.reshape(-1) for _, t in data["named"]])
    assert torch.equal(flat, run.optimizer.main.detach())
    moments = data["optimizer"]["state"][0]
    assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32
    weights = core_file.weights(tmp_path)  # what a resumed standalone engine loads
    assert [n for n, _ in weights] == [n for n, _ in data["named"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(weights, data["named"]))

    resumed = _replica("bfloat16")
    assert resumed.restore(tmp_path) == 1
    assert torch.equal(resumed.optimizer.main.detach(), run.optimizer.main.detach())
    assert torch.equal(resumed.cell.flat_params, run.cell.flat_params)
    second, info2 = _batch(tiny, 1)
    for replica in (run, resumed):
        _update(replica, second, info2)
    assert torch.equal(resumed.optimizer.main.detach(), run.optimizer.main.detach())
    assert torch.equal(resumed.cell.flat_params, run.cell.flat_params)
    a, b = (r.optimizer.opt.state[r.optimizer.main] for r in (run, resumed))
    assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))

    other = _replica("float32")  # another dtype resumes from the same float32 state
    other.restore(tmp_path)
    assert torch.equal(other.cell.flat_params, flat)


# ---- moving the state: residency, MPI, snapshots ---------------------------------------------


def test_the_main_weights_move_with_the_residency() -> None:
    """A colocated bf16 core's float32 main weights leave the device with the rest and
    training after release and restore equals training never released."""
    from gyre.runtime.cell.residency import TrainerResidency

    def core() -> tuple[TorchCell, CoreOptimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
        cell = TorchCell(model, objective=ObjectiveConfig(), dtype=torch.bfloat16)
        return cell, CoreOptimizer(cell, OptimConfig(lr=1e-2))

    moved: list[str] = []

    def mover(what: str, t: torch.Tensor, device: str) -> torch.Tensor:
        moved.append(what)
        return t.clone()

    (cell, opt), (ref, ref_opt) = core(), core()
    residency = TrainerResidency(device="cuda:0", move=mover)
    x = torch.randn(5, 4).bfloat16()
    for _ in range(3):
        for c, o in ((cell, opt), (ref, ref_opt)):
            c.zero_grad()
            c.model(x).float().square().sum().backward()
            o.step(c.flat_grads)
        residency.release(cell, opt)
        residency.restore(cell, opt)
    assert moved[:5] == ["flat_params", "flat_grads", "optimizer.main", "optimizer.exp_avg",
                         "optimizer.exp_avg_sq"]  # fmt: skip
    assert torch.equal(opt.main.detach(), ref_opt.main.detach())
    assert torch.equal(cell.flat_params, ref.flat_params)
    assert all(p.grad is None for p in trainable(cell.model))
    cell.zero_grad()
    cell.model(x).float().square().sum().backward()  # the hooks add into the new buffer
    ref.zero_grad()
    ref.model(x).float().square().sum().backward()
    assert torch.equal(cell.flat_grads, ref.flat_grads) and float(cell.flat_grads.norm()) > 0


def test_bf16_weights_cross_mpi_and_snapshots_as_their_bits() -> None:
    """numpy has no bfloat16: broadcasts and snapshots carry a bf16 buffer as its 16-bit
    words (every bit kept); a sum of bf16 words over MPI is refused (sums are float32)."""
    from gyre.errors import TrainingError
    from gyre.train.comm import _host
    from gyre.train.transfer import _bytes

    flat = torch.randn(7).bfloat16()
    words, host = _host(flat)
    assert host is flat and words.nbytes == 14
    words[:] = 0  # a view: what MPI writes into it lands in the tensor
    assert float(flat.abs().sum()) == 0
    with pytest.raises(TrainingError, match="sums are float32"):
        _host(flat, summed=True)
    src = torch.randn(9).bfloat16()  # a snapshot's bytes and back, as a device copy reads them
    assert torch.equal(torch.from_numpy(_bytes(src).copy()).view(torch.bfloat16), src)
