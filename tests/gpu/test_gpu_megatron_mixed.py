"""bf16 with the Megatron backend on CPU (one rank, in-process): the replica the backend builds
for `train.dtype: bfloat16` holds bf16 parameters (and sends bf16 Hugging Face tensors: what
engines load), float32 gradients, main weights and moments; its checkpoint keeps the float32
state in the Hugging Face layout, so a resume continues bit for bit and the torch backend
resumes from it with exactly its main weights. TP x PP in bf16:
tests/gpu/test_gpu_megatron_cpu.py; the mixed-precision step itself:
tests/train/test_train_mixed_precision.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gyre.train.config import ParallelDims, TrainConfig
from gyre.train.objective import batch_gradient, execution_scalars, merge_sums
from gyre.train.packing import pack_rows
from gyre.train.synthetic import random_batch

DIMS = ParallelDims(tensor=1, pipeline=1, data=1)


def _replica(name: str, dtype: str) -> Any:
    from gyre.train.backends import backend
    from gyre.train.comm import Communicators

    train = TrainConfig(dtype=dtype, lr=1e-3)  # type: ignore[arg-type]
    return backend(name).build("tiny", train, DIMS, core=True, device="cpu",
                               comms=Communicators.alone(0))  # fmt: skip


def _update(replica: Any, seed: int) -> None:
    rows, info = random_batch(np.random.default_rng(seed), executions=4, vocab=4096,
                              length=(8, 30))  # fmt: skip
    steps, cell = pack_rows(rows, token_budget=300), replica.cell
    scalars = execution_scalars(merge_sums([cell.prepass(s) for s in steps]), info.executions,
                                cell.objective)  # fmt: skip
    cell.zero_grad()
    for s in steps:
        cell.accumulate(s, scalars)
    replica.optimizer.step(batch_gradient(cell.flat_grads, info.num_executions))


def _state(replica: Any) -> dict[str, torch.Tensor]:
    opt = replica.optimizer
    moments = opt.opt.state[opt.main]
    return {"main": opt.main.detach(), "params": replica.cell.flat_params,
            "exp_avg": moments["exp_avg"], "exp_avg_sq": moments["exp_avg_sq"]}  # fmt: skip


def test_a_bf16_megatron_replica_resumes_exactly(megatron_world: None, tmp_path: Path) -> None:
    from gyre.train import core_file

    run = _replica("megatron", "bfloat16")
    cell = run.cell
    assert cell.mixed and cell.flat_params.dtype == torch.bfloat16
    assert cell.flat_grads.dtype == run.optimizer.main.dtype == torch.float32
    _update(run, 0)
    assert all(p.grad is None for p in cell.model.parameters())  # added into flat_grads
    assert torch.equal(cell.flat_params, run.optimizer.main.detach().bfloat16())
    part = run.part(0)  # one stage, one rank: the whole model, what engines load
    assert part is not None and {t.dtype for _, t in part} == {torch.bfloat16}
    sent = torch.cat([dict(part)[n].reshape(-1) for n, _ in run.hf_shapes()])  # HF order
    assert torch.equal(sent, run.hf_flat(cell.flat_params))  # the model's weights, gathered
    run.save(tmp_path, version=1, shard=0)
    data = core_file.load(tmp_path)
    flat = torch.cat([t.reshape(-1) for _, t in data["named"]])
    assert flat.dtype == torch.float32 and torch.equal(flat, run.hf_flat(run.optimizer.main))

    resumed = _replica("megatron", "bfloat16")
    assert resumed.restore(tmp_path) == 1
    for key, value in _state(run).items():
        assert torch.equal(_state(resumed)[key], value), key
    _update(run, 1)
    _update(resumed, 1)
    for key, value in _state(run).items():
        assert torch.equal(_state(resumed)[key], value), key

    torch_replica = _replica("torch", "bfloat16")  # the other backend, the same state
    torch_replica.restore(tmp_path)
    assert torch.equal(torch_replica.optimizer.main.detach(), flat)
    assert torch.equal(torch_replica.cell.flat_params, flat.bfloat16())


@pytest.fixture(autouse=True)
def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
