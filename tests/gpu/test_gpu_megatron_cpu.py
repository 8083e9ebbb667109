"""Megatron-core forward and backward on this CPU, and its CUDA build path.

Gyre's GPTModel of the tiny Qwen2 (built by `build_rank_model`, the backend's build, with
gyre.train.megatron.cpu's patches) against transformers' own model at TP = 2, PP = 2 and
TP 2 x PP 2 over gloo processes, with the SDPA core attention and, at TP = 2, Megatron's
`DotProductAttention`, sequence parallel (the default at TP > 1: rows of odd width padded to
a multiple of TP, the norms' gradients summed over the TP ranks) and not
(vocab-parallel chunked log-probs; the stages' hidden states and input
gradients sent stage to stage, the tied embedding's two copies summed; shards gathered back
to the Hugging Face layout). And the CUDA build path run here with only the CUDA device
stood in (megatron_cuda_path_probe.py): Megatron seeded, its first forward runs, each CPU
patch off; a CPU model on a machine with CUDA gets the patches."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from processes import rendezvous

from gyre.train.packing import MicroStep

if importlib.util.find_spec("megatron.core") is None:  # imported where used, not at collection
    pytest.skip("megatron-core not installed (extra gyre[gpu])", allow_module_level=True)
WORKER = Path(__file__).with_name("megatron_tp_worker.py")
PROBE = Path(__file__).with_name("megatron_cuda_path_probe.py")

from megatron_steps import micro_step  # noqa: E402  (tests/gpu, on sys.path)


def _step() -> MicroStep:
    return micro_step((13, 7, 9))  # an odd width: sequence parallelism pads it


def _hf_reference(step: MicroStep) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' tiny Qwen2: target log-probs and the gradient of their sum."""
    from gyre.models import load_model
    from gyre.train.objective import step_tensors, target_logprobs

    hf, _ = load_model("tiny")
    hf.train()
    st = step_tensors(step)
    logp = target_logprobs(hf(input_ids=st.ids, attention_mask=st.attention).logits, st.ids)
    (logp * st.targets).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def _run_world(
    workers: Any,
    tmp_path: Path,
    step: MicroStep,
    tp: int,
    pp: int,
    dtype: str,
    attention: str = "sdpa",
    sequence: str = "auto",
) -> list[dict]:
    """Every rank's results of one micro-step through a TP x PP world of gloo processes."""
    torch.save(step, tmp_path / "step.pt")
    init, world = rendezvous(tmp_path), tp * pp
    procs = [subprocess.Popen(workers.command(WORKER, r, world, init, tmp_path, pp, dtype,
                                              attention, sequence),
                              env=workers.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert all(r["patched"] for r in ranks)  # the CPU patches were in force
    return ranks


def _targets(step: MicroStep, shape: tuple[int, ...]) -> torch.Tensor:
    targets = torch.from_numpy(np.zeros(shape, bool))
    for k, row in enumerate(step.rows):
        targets[k, : row.length] = torch.from_numpy(row.targets)
    return targets


def _hf_grads(ranks: list[dict], tp: int) -> dict[str, torch.Tensor]:
    from gyre.models import load_model
    from gyre.train.megatron.weights import WeightLayout, stages_to_hf

    hf_config = load_model("tiny")[0].config.to_dict()
    return stages_to_hf(
        [r["grads"] for r in ranks], WeightLayout.from_hf_config(hf_config), tp_size=tp
    )


# TP = 1, PP = 1: test_gpu_megatron_weights.py, in-process
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,attention,sequence",
                         [(2, 1, "sdpa", "auto"), (2, 1, "sdpa", "off"), (1, 2, "sdpa", "auto"),
                          (2, 2, "sdpa", "auto"), (2, 1, "local", "auto")])  # fmt: skip
def test_megatron_tp_matches_transformers_on_cpu(
    workers: Any, tmp_path: Path, tp: int, pp: int, attention: str, sequence: str
) -> None:
    """Log-probs and gradients of one micro-step within 2e-5 / 1e-4 relative of transformers';
    sequence parallelism ("auto": on at TP 2) pads the 13-token rows to 14."""
    step = _step()
    ranks = _run_world(workers, tmp_path, step, tp, pp, "float32", attention, sequence)
    assert {r["sequence_parallel"] for r in ranks} == {tp > 1 and sequence != "off"}
    want_logp, want_grads = _hf_reference(step)
    targets = _targets(step, tuple(want_logp.shape))
    for r in ranks:  # every rank has the whole rows' log-probs (vocab-parallel CE, broadcast)
        assert (r["logp"][targets] - want_logp[targets]).abs().max() < 2e-5
    got = _hf_grads(ranks, tp)
    assert set(got) == set(want_grads) - {"lm_head.weight"}  # tied to the embedding
    for name, g in got.items():
        ref = want_grads[name]
        assert float((g - ref).norm()) <= 1e-4 * float(ref.norm()) + 1e-7, name


@pytest.fixture(scope="module")
def cuda_path(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """megatron_cuda_path_probe.py's report: the CUDA build path run here with only the CUDA
    device stood in (one subprocess for the module: the stand-ins are process-wide)."""
    out = tmp_path_factory.mktemp("cuda_path") / "probe.json"
    proc = subprocess.run([sys.executable, str(PROBE), str(out)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.slow
def test_megatron_bf16_tp_and_pp_match_transformers_within_bf16_tolerance(
    workers: Any, tmp_path: Path
) -> None:
    """bf16 at TP 2 x PP 2 (mixed precision: float32 log-probs from the vocab-parallel
    cross-entropy, bf16 hidden states between the stages, gradients added up in float32, the
    tied embedding's two float32 copies summed) against transformers in float32, within
    tests/train/test_train_mixed_precision.py's T(n) = 2 sqrt(n) 2^-8: the log-probs' rms
    error within T(n_f) of the logits' rms, the gradient's relative L2 error within T(n_b)."""
    from gyre.models import load_model
    from gyre.train.objective import step_tensors

    step = _step()
    ranks = _run_world(workers, tmp_path, step, 2, 2, "bfloat16")
    want_logp, want_grads = _hf_reference(step)
    targets = _targets(step, tuple(want_logp.shape))
    hf, st = load_model("tiny")[0], step_tensors(step)
    n_f = 16 * hf.config.num_hidden_layers + 3  # bf16 roundings of the forward
    with torch.no_grad():
        scale = float(
            hf(input_ids=st.ids, attention_mask=st.attention).logits.square().mean().sqrt()
        )
    for r in ranks:
        assert r["logp"].dtype == torch.float32
        err = (r["logp"][targets] - want_logp[targets]).square().mean().sqrt()
        assert float(err) <= 2 * (n_f**0.5) * 2.0**-8 * scale
    got = _hf_grads(ranks, 2)
    assert {g.dtype for g in got.values()} == {torch.float32}
    names = sorted(got)
    g = torch.cat([got[n].reshape(-1) for n in names])
    ref = torch.cat([want_grads[n].reshape(-1) for n in names])
    assert float((g - ref).norm()) <= 2 * ((2 * n_f) ** 0.5) * 2.0**-8 * float(ref.norm())


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_the_cuda_build_path_seeds_megatron_and_runs_its_first_forward(
    cuda_path: dict[str, Any], attention: str
) -> None:
    """`build_rank_model(..., device="cuda:0")` (the backend's build) with CUDA stood in and
    no CPU patch: Megatron's attention forks the "model-parallel-rng" state at the first
    forward, which exists only because the build seeded it (without
    `model_parallel_cuda_manual_seed` this reads "cuda rng state model-parallel-rng is not
    added"); the loaded weights give transformers' log-probs."""
    got = cuda_path["cuda"][attention]
    assert got["ok"], got["error"]
    assert got["max_logprob_gap"] < 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("patch",
                         ["rotary", "tied_embedding", "router", "sequence_parallel",
                          "memory_buffer", "rng_tracker"])  # fmt: skip
def test_each_cpu_patch_is_off_on_the_cuda_path(cuda_path: dict[str, Any], patch: str) -> None:
    """After the CUDA build path and its forward, Megatron's own object is in place: the
    rotary embedding's `get_emb`, the tied-embedding setup, the router's gating, the
    sequence-parallel collectives, the global memory buffer, and the model-parallel RNG
    tracker (its training tracker, seeded)."""
    assert cuda_path["patches"]["active"] is False
    assert cuda_path["patches"][patch] is True, f"cpu.py's {patch} patch is on the CUDA path"


@pytest.mark.slow
def test_a_cpu_model_on_a_gpu_machine_is_patched(cuda_path: dict[str, Any]) -> None:
    """`train.device: cpu` where CUDA is visible: the patches follow the model's device, not
    the machine, so the CPU build runs (unpatched Megatron would put the rotary table and its
    scratch buffer on the GPU)."""
    got = cuda_path["cpu_on_gpu_machine"]
    assert got["ok"], got.get("error")
    assert got["patched"] and got["max_logprob_gap"] < 2e-5
