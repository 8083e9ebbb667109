"""Megatron's CUDA build path run on this CPU, with only the CUDA device stood in, for
test_gpu_megatron_cpu.py.

    python megatron_cuda_path_probe.py OUT_JSON

The stand-ins (installed before megatron-core is imported) answer what a one-GPU machine
answers — CUDA is available, device 0 is current, the device's RNG state can be read, set
and seeded (a host `torch.Generator` holds it) — except that "the current device" is host
memory, so every tensor Megatron puts on it is a CPU tensor. Nothing of megatron-core or of
`gyre.train.megatron.cpu` is patched. Then, over a one-rank gloo world:

1. the CUDA build path, `build_rank_model(..., device="cuda:0")` as the Megatron backend
   calls it, for the tiny Qwen2 with each core attention ("sdpa", "local"), and the first
   forward + backward through `MegatronCell`: its log-probs against transformers', or the
   error it raised; and the state of each of `cpu.py`'s six patches afterwards;
2. the CPU path on this "GPU machine" (`train.device: cpu` on a GPU node): the same build
   with `device="cpu"` — the patches are on and the forward runs.

Writes {"cuda": {attention: result}, "patches": {...}, "cpu_on_gpu_machine": result}.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

_DEVICE_RNG = torch.Generator()  # the stood-in device's default generator


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return _DEVICE_RNG.get_state()


def _set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
    _DEVICE_RNG.set_state(state)


def _manual_seed(seed: int) -> None:
    _DEVICE_RNG.manual_seed(seed)


def stand_in_cuda() -> None:
    """torch.cuda as on a one-GPU machine whose device memory is host memory."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    for module in (torch.cuda, torch.cuda.random):
        module.get_rng_state = _get_rng_state  # type: ignore[attr-defined]
        module.set_rng_state = _set_rng_state  # type: ignore[attr-defined]
        module.manual_seed = _manual_seed  # type: ignore[attr-defined]


def _step() -> Any:
    from megatron_steps import micro_step  # beside this script, on sys.path

    return micro_step((12, 7))


def first_pass(hf: Any, attention: str, device: str) -> dict[str, Any]:
    """The backend's build on `device`, then one forward + backward; the log-probs' largest
    difference from transformers' at the targets, or the error."""
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore
    from gyre.train.objective import ObjectiveConfig, step_tensors, target_logprobs

    hfc = hf.config.to_dict()
    cfg = MegatronConfig(dtype="float32", attention=attention)  # type: ignore[arg-type]
    shard = stage_to_mcore(dict(hf.state_dict()), WeightLayout.from_hf_config(hfc), tp_rank=0,
                           tp_size=1, stage=0, stages=1)  # fmt: skip
    step = _step()
    st = step_tensors(step)
    with torch.no_grad():
        want = target_logprobs(hf(input_ids=st.ids, attention_mask=st.attention).logits, st.ids)
    try:
        cell = MegatronCell(build_rank_model(hfc, shard, cfg, device=device),
                            objective=ObjectiveConfig())  # fmt: skip
        logp, st = cell._logprobs(step, grad=True)
        cell._backward((logp * st.targets).sum())
    except Exception as e:  # reported to the test
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    gap = float((logp.detach() - want)[st.targets].abs().max())
    return {"ok": True, "max_logprob_gap": gap}


def patches() -> dict[str, Any]:
    """Each of cpu.py's six patches: whether Megatron's own object is in place."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import layers, mappings, random
    from megatron.core.transformer.moe.router import Router
    from megatron.core.utils import GlobalMemoryBuffer

    from gyre.train.megatron import cpu

    tracker = random.get_cuda_rng_tracker()
    tied = LanguageModule.setup_embeddings_and_output_layer
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    return {
        "active": cpu.active(),
        "rotary": not hasattr(RotaryEmbedding.get_emb, "__wrapped__"),
        "tied_embedding": not hasattr(tied, "__wrapped__"),
        "router": not hasattr(Router.gating, "__wrapped__"),
        "sequence_parallel": not any(
            hasattr(getattr(mappings, name), "__wrapped__") for name in cpu.SEQUENCE_COLLECTIVES
        )
        and not hasattr(linear.backward, "gyre_cpu_patch"),
        "memory_buffer": type(parallel_state.get_global_memory_buffer()) is GlobalMemoryBuffer,
        # Megatron's training tracker, seeded (cpu.py's is its stateless inference tracker)
        "rng_tracker": type(tracker) is random.CudaRNGStatesTracker
        and "model-parallel-rng" in tracker.get_states(),
    }


def main(out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    stand_in_cuda()
    import torch.distributed as dist

    from gyre.models import load_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    hf, _ = load_model("tiny")
    result: dict[str, Any] = {"cuda": {a: first_pass(hf, a, "cuda:0") for a in ("sdpa", "local")}}
    result["patches"] = patches()
    result["cpu_on_gpu_machine"] = {**first_pass(hf, "sdpa", "cpu"), "patched": patches()["active"]}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
