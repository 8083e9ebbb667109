"""Core attention on `torch.nn.functional.scaled_dot_product_attention`: memory linear in the row.

Megatron-core's local layer spec computes attention with `DotProductAttention`, which
materialises a row's scores and probabilities (`[rows, heads, len, len]`, and a causal mask of
`len x len` beside them): quadratic memory, ~7.5 GB per layer for one 16k-token row of a 7B
model at TP 4 in float32. `SDPAttention` is a drop-in for it in the layer spec (the same
constructor arguments from `SelfAttention`, the same forward `(query, key, value,
attention_mask, attn_mask_type, attention_bias, packed_seq_params)`, query `[s, b, np, hn]`,
key and value `[s, b, ng, hn]` of this rank's heads and query groups, output `[s, b, np * hn]`)
that hands the causal attention to torch's fused kernels: flash or memory-efficient
attention on a GPU, flash attention on the CPU, none of which holds the scores. Grouped-query
attention goes to the kernel as is (`enable_gqa`: query head i reads key / value group
i // (np / ng), Megatron's `repeat_interleave` order). Dropout is taken, as in
`DotProductAttention`, inside the model-parallel RNG tracker's fork (so the CUDA build path
needs Megatron's seeding either way, `gyre.train.megatron.model.init_model_parallel`).

With `attention_mask=None` the attention is causal (`attn_mask_type` causal, the layer
spec's); `MegatronCell` passes no mask to this attention, so no `len x len` tensor exists. A
boolean mask (Megatron's convention: True = masked out) is still honoured.

    spec = layer_spec("sdpa")        # the local spec with SDPAttention as core attention
    spec = layer_spec("sdpa", qk_layernorm=True, num_experts=8)   # Qwen3-MoE's layer
    block = block_spec(spec, config)  # this stage's layers and the final norm, for GPTModel

Every norm of the spec (the layers', the q / k norms and the final one) is Gyre's `RMSNorm`
(`gyre.train.megatron.norm`: torch's, allowed under sequence parallelism).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from gyre.train.megatron.config import ATTENTIONS
from gyre.train.megatron.norm import RMSNorm


class SDPAttention(MegatronModule):  # type: ignore[misc]
    """Causal core attention of this rank's heads through torch's fused SDPA kernels."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        _check_supported(config)
        tp = pg_collection.tp.size() if pg_collection is not None else (
            parallel_state.get_tensor_model_parallel_world_size())  # fmt: skip
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"attention: heads {config.num_attention_heads} / query groups "
                             f"{config.num_query_groups} not divisible by TP {tp}")  # fmt: skip
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.attn_mask_type = attn_mask_type
        # DotProductAttention's scale; its apply_query_key_layer_scaling divides the scale by
        # the layer number and multiplies the scores back by it: the same softmax input
        self.scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(
            config.kv_channels)  # fmt: skip
        self.dropout = config.attention_dropout if attention_dropout is None else (
            attention_dropout)  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """[sq, b, np, hn] queries over [sk, b, ng, hn] keys and values → [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias are not supported")
        sq, b = query.shape[0], query.shape[1]
        causal = attention_mask is None
        if causal:
            kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            if kind != AttnMaskType.causal or sq != key.shape[0]:
                raise ValueError(f"SDPAttention: no mask given for a {kind} attention of "
                                 f"{sq} queries over {key.shape[0]} keys; allowed: causal "
                                 "self-attention, or an explicit mask")  # fmt: skip
        p = self.dropout if self.training else 0.0
        keep = None if attention_mask is None else ~attention_mask  # SDPA's: True = attend
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        with _dropout_rng(self.config):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=p, is_causal=causal, scale=self.scale,
                enable_gqa=self.heads != self.groups,
            )  # fmt: skip
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * query.shape[-1])


def _dropout_rng(config: TransformerConfig) -> Any:
    """Where `DotProductAttention` draws its dropout: the model-parallel RNG state (each TP
    rank its own heads' mask), except under sequence parallelism."""
    if config.sequence_parallel:
        import contextlib

        return contextlib.nullcontext()
    return tensor_parallel.get_cuda_rng_tracker().fork()


def _check_supported(config: TransformerConfig) -> None:
    """Refuse the DotProductAttention features this attention does not reproduce."""
    unsupported = {
        "context_parallel_size": (config.context_parallel_size, 1),
        "window_size": (config.window_size, None),
        "softmax_type": (config.softmax_type, "vanilla"),
    }
    for name, (value, allowed) in unsupported.items():
        if value != allowed:
            raise ValueError(f"SDPAttention: {name} {value!r}; allowed {allowed!r}")


def layer_spec(attention: str, *, qk_layernorm: bool = False,
               num_experts: int | None = None) -> ModuleSpec:  # fmt: skip
    """Megatron's local GPT layer spec (RMSNorm) with `attention` as its core attention:
    "sdpa" (`SDPAttention`, linear memory) or "local" (Megatron's `DotProductAttention`).
    `qk_layernorm`: each head's queries and keys RMS-normalized after the QKV projection
    (Qwen3; the spec's `q_layernorm` / `k_layernorm`, over `kv_channels`, either attention).
    `num_experts`: the MLP is Megatron's `MoELayer` (router, experts run one after another,
    optional shared expert) instead of the dense MLP."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: {attention!r}; allowed {', '.join(ATTENTIONS)}")
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")  # a fresh spec on every call  # fmt: skip
    layer, attn = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    if attention == "sdpa":
        attn.core_attention = SDPAttention
    return spec


def block_spec(layer: ModuleSpec, config: TransformerConfig) -> TransformerBlockSubmodules:
    """This pipeline stage's layers of `layer` and the final norm (Gyre's `RMSNorm`, where
    GPTModel given a layer spec alone would take megatron-core's default norm, which refuses
    sequence parallelism without Transformer Engine or Apex)."""
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm
    )
