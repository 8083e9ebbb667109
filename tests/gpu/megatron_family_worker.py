"""One rank of a tensor-parallel Megatron world on CPU (gloo) running a tiny random model of one
family, for test_gpu_megatron_families.py.

    python megatron_family_worker.py RANK WORLD INIT OUT_DIR FAMILY \
        [ATTENTION [PIPELINE [SEQUENCE [EXPERT]]]]

FAMILY is a key of `FAMILIES` (Qwen3 dense, Qwen3-MoE with and without renormalized top-k,
Qwen2-MoE with its gated shared expert). The model is transformers' own, built from a config
in code under a seed (`tiny_family`), every weight drawn at random so each one matters. The
rank (TP rank RANK % TP of pipeline stage RANK // TP, TP = WORLD / PIPELINE) cuts its shard
from the HF state dict (`stage_to_mcore`), builds Gyre's GPTModel (`build_rank_model`, the
backend's build; core attention ATTENTION, "sdpa" or "local"; sequence parallelism SEQUENCE,
"on", "off" or "auto": on at TP > 1; expert parallelism EXPERT, default 1, the routed
experts split over the TP ranks in EXPERT blocks), runs OUT_DIR/step.pt's rows through
`MegatronCell` (vocab-parallel chunked log-probs) and the cell's backward of the summed
target log-probs, and writes to OUT_DIR/rank<R>.pt its log-probs, its vocabulary shard of
the logits (one stage only), its shard's gradients and its loaded weights (Megatron names).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3"},
    "qwen3_tied": {"model_type": "qwen3", "tie_word_embeddings": True},
    "qwen3_moe": {"model_type": "qwen3_moe", "norm_topk_prob": True},
    "qwen3_moe_plain_topk": {"model_type": "qwen3_moe", "norm_topk_prob": False},
    "qwen2_moe": {"model_type": "qwen2_moe", "norm_topk_prob": False},
}


def tiny_family(family: str, experts: int = 4) -> torch.nn.Module:
    """transformers' model of `family`, tiny, random and deterministic: head_dim 12, not
    hidden / heads (8); `experts` experts, top 2; every weight drawn (norms around 1)."""
    from transformers import (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    spec = dict(FAMILIES[family])
    kind = spec.pop("model_type")
    common = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **spec}  # fmt: skip
    moe = {"moe_intermediate_size": 16, "num_experts": experts, "num_experts_per_tok": 2}
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=12, **common))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=12, **moe, **common))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(shared_expert_intermediate_size=24, **moe,
                                                   **common))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model.float()


def main(
    rank: int,
    world: int,
    init: str,
    out: str,
    family: str,
    attention: str,
    pipeline: int,
    sequence: str = "auto",
    expert: int = 1,
) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=world)  # fmt: skip
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model, pad_to_multiple
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore, tensor_state
    from gyre.train.objective import ObjectiveConfig, step_tensors

    hf = tiny_family(family)
    hfc = hf.config.to_dict()
    tp = world // pipeline
    layout = WeightLayout.from_hf_config(hfc, expert_parallel=expert)
    shard = stage_to_mcore(dict(hf.state_dict()), layout,
                           tp_rank=rank % tp, tp_size=tp, stage=rank // tp,
                           stages=pipeline)  # fmt: skip
    mcfg = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pipeline, dtype="float32",
                          attention=attention, expert_parallel=expert,  # type: ignore[arg-type]
                          sequence_parallel={"auto": None, "on": True, "off": False}[sequence])  # fmt: skip
    model = build_rank_model(hfc, shard, mcfg, device="cpu")
    loaded = {k: v.detach().clone() for k, v in tensor_state(model).items()}
    cell = MegatronCell(model, objective=ObjectiveConfig())
    step = torch.load(f"{out}/step.pt", weights_only=False)
    st = step_tensors(step)
    width = st.ids.shape[1]  # sequence parallel: padded to a multiple of TP, as the cell does
    ids = pad_to_multiple(st.ids, tp if mcfg.sequence else 1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
    logits = None
    if pipeline == 1:  # a stage's forward alone needs its neighbours: logits at PP 1 only
        with torch.no_grad():  # causal (Megatron's mask convention: True = masked out)
            logits = model(ids, positions, mask)[:, :width]
    logp, st = cell._logprobs(step, grad=True)
    cell._backward((logp * st.targets).sum())
    grads = {n: cell.grad_of(p).detach().clone() for n, p in model.named_parameters()}
    torch.save({"logp": logp.detach(), "logits": logits, "grads": grads, "weights": loaded,
                "sequence_parallel": model.config.sequence_parallel}, f"{out}/rank{rank}.pt")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
        sys.argv[6] if len(sys.argv) > 6 else "sdpa",
        int(sys.argv[7]) if len(sys.argv) > 7 else 1,
        sys.argv[8] if len(sys.argv) > 8 else "auto",
        int(sys.argv[9]) if len(sys.argv) > 9 else 1,
    )
