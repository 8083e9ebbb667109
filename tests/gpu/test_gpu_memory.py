"""Placement, the training cell's release/restore (`TrainerResidency`) and the embedded engine's
CUDA launcher (through tools/gpu_check.py, test_gpu_check.py) — exercised on CPU here (the same code paths minus pinning and the CUDA cache),
and on CUDA when a device is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train.reference import train_batch_reference

from gyre.errors import ConfigError, TrainingError
from gyre.gpu.memory import Placement, measure, memory_stats
from gyre.runtime.cell.residency import TrainerResidency
from gyre.train.cell import CoreOptimizer, TorchCell
from gyre.train.config import ObjectiveConfig, OptimConfig
from gyre.train.packing import pack_rows
from gyre.train.stream import BatchInfo
from gyre.train.synthetic import TinyCausalLM, random_batch


def test_placement_validates():
    assert Placement().torch_dtype is torch.float32
    with pytest.raises(ConfigError, match="dtype: 'int4'"):
        Placement(dtype="int4")
    with pytest.raises(ConfigError, match="device: 'tpu'"):
        Placement(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            Placement(device="cuda")
    m = Placement(dtype="bfloat16").apply(torch.nn.Linear(2, 2))
    assert m.weight.dtype is torch.bfloat16


def _batch(seed=0):
    rows, info = random_batch(np.random.default_rng(seed), executions=4, vocab=512)
    return pack_rows(rows, token_budget=512), BatchInfo(
        executions=info.executions, group_ids=[], policy_versions=[]
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cell_release_resume_keeps_weights_and_training(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    obj = ObjectiveConfig()
    cell = TorchCell(TinyCausalLM(seed=3).to(device), objective=obj)
    ref = TorchCell(TinyCausalLM(seed=3).to(device), objective=obj)
    before = cell.flat_params.clone()
    off = TrainerResidency(device=device)  # what a colocated cell rank runs on each switch
    report = measure(lambda: off.release(cell), device)
    assert off.released and cell.flat_params.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in cell.model.parameters())
    if device == "cuda":
        assert report.after["allocated"] < report.before["allocated"]
    with pytest.raises(TrainingError, match="already released"):
        off.release(cell)
    off.restore(cell)
    assert torch.equal(cell.flat_params, before)
    # parameters are views of the flat buffer again: an update through it reaches the model
    steps, info = _batch()
    a = train_batch_reference([cell], CoreOptimizer(cell, OptimConfig(lr=1e-3)), steps, info,
                              objective=obj)  # fmt: skip
    b = train_batch_reference([ref], CoreOptimizer(ref, OptimConfig(lr=1e-3)), steps, info,
                              objective=obj)  # fmt: skip
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
    assert torch.allclose(cell.flat_params, ref.flat_params)
    first = next(cell.model.parameters())
    assert first.data_ptr() == cell.flat_params.data_ptr()


def test_memory_stats_on_cpu_are_zero():
    assert memory_stats("cpu") == {"allocated": 0, "reserved": 0, "free": 0, "total": 0}


def test_embedded_engine_samples_with_generators_on_its_device():
    """`torch.multinomial` refuses a generator of another device than its input, and the
    engine samples from logits on the model's device: every sampled call's generator is
    made there. On CPU: a CPU engine's generators are CPU ones (seeded runs repeat), and an
    engine whose model sits on CUDA asks for a CUDA generator (which this build of torch
    cannot make: the request itself is what is checked)."""
    from gyre.models import load_model
    from gyre.rollout.engine import Config, Engine
    from gyre.rollout.protocol import GenerateRequest, SamplingParams

    model, tok = load_model("tiny")
    engine = Engine(Config(), model, tok)
    assert engine.device == torch.device("cpu")
    a, b = engine.generator(7), engine.generator(7)
    assert a.device == engine.device
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))

    def sampled(rid: str) -> GenerateRequest:
        sp = SamplingParams(max_new_tokens=2, temperature=0.8, sampling_seed=3)
        return GenerateRequest(rid=rid, input_ids=[1, 2], sampling=sp, return_logprob=True)

    engine.submit(sampled("on-cpu"), lambda body: None)  # queued: the loop is not started
    engine.device = torch.device("cuda")  # where CudaEngine's model lives
    if torch.cuda.is_available():
        engine.submit(sampled("on-cuda"), lambda body: None)
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            engine.submit(sampled("on-cuda"), lambda body: None)


def test_a_parked_megatron_cell_frees_megatrons_scratch(megatron_world):
    """A Megatron trainer's park (`TrainerResidency.release`) also lets go of what megatron-core
    keeps between passes — its global memory buffer (core attention's workspace) and RoPE's
    cache of position embeddings — beside the flat buffers, the AdamW moments and the norm
    mask; after the restore the cell computes bitwise the same log-probs."""
    import gc
    import warnings

    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from torch.multiprocessing.reductions import StorageWeakRef

    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, ModelParallelOptimizer, build_gpt_model
    from gyre.train.packing import MicroStep, TokenRow

    hfc = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
           "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
           "vocab_size": 64, "tie_word_embeddings": True}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Megatron's own core attention: the one that keeps a scratch buffer between passes
        model = build_gpt_model(hfc, MegatronConfig(dtype="float32", attention="local"),
                                device="cpu")  # fmt: skip
    with torch.no_grad():  # built uninitialized (the backend loads weights next)
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    cell = MegatronCell(model, objective=ObjectiveConfig())
    opt = ModelParallelOptimizer(cell, OptimConfig(lr=1e-2))
    opt.step(torch.randn_like(cell.flat_params))  # AdamW moments exist
    targets = np.arange(10) >= 4
    step = MicroStep(index=0, rows=(TokenRow(
        execution_id="e0", group_id="g0", policy_version=0,
        ids=np.random.default_rng(0).integers(0, 64, 10), targets=targets,
        behaviour_logprobs=np.where(targets, -1.0, 0.0), advantage=1.0,
        execution_targets=int(targets.sum()), weights=targets / targets.sum()),))  # fmt: skip
    before = cell.prepass(step)
    scratch = parallel_state.get_global_memory_buffer().buffer
    assert scratch and RotaryEmbedding.forward.cache_info().currsize > 0
    state = opt.opt.state[opt._param]
    held = {"flat_params": cell.flat_params, "flat_grads": cell.flat_grads, "mask": opt._mask,
            "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
            **{f"scratch {k}": t for k, t in scratch.items()}}  # fmt: skip
    refs = {k: StorageWeakRef(t.untyped_storage()) for k, t in held.items()}
    del held, state
    residency = TrainerResidency(device="cpu")
    residency.release(cell, opt)
    gc.collect()
    assert [k for k, r in refs.items() if not r.expired()] == []
    assert not parallel_state.get_global_memory_buffer().buffer
    assert RotaryEmbedding.forward.cache_info().currsize == 0
    residency.restore(cell, opt)
    assert cell.prepass(step) == before
