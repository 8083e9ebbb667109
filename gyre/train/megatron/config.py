"""Typed configuration of the Megatron-core backend and the HF config → TransformerConfig map.

Torch-free, so CLI modules and config loading can import it. `transformer_kwargs(hf)` turns a
Hugging Face `config.json` (a dict) of one of the `SUPPORTED_MODEL_TYPES` (Qwen2, Llama, Qwen3
and the mixture-of-experts Qwen3-MoE and Qwen2-MoE) into the keyword arguments of
`megatron.core.transformer.TransformerConfig` plus the `GPTModel` arguments (`gpt_kwargs`,
RoPE scaling included: `rope_scaling_kwargs` maps HF's linear and llama3 scaling and refuses
what Megatron's `RotaryEmbedding` cannot reproduce, such as yarn or dynamic). The family
decides three things besides the shapes: QKV bias (Qwen2, Qwen2-MoE), per-head q/k RMSNorm
(Qwen3, Qwen3-MoE: Megatron's `qk_layernorm`) and routed experts (`moe_kwargs`):

Expert parallelism (`expert_parallel`, EP) folds a MoE model's routed experts onto the
tensor-parallel ranks: EP divides TP and the expert count, each expert split over ETP = TP / EP
ranks, no expert data parallelism inside a cell (`expert_model_parallel_size` /
`expert_tensor_parallel_size` of both `parallel_state` and the `TransformerConfig`).

    cfg = MegatronConfig(tensor_parallel=2, dtype="bfloat16")
    tk, gk = transformer_kwargs(hf_config, cfg), gpt_kwargs(hf_config)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gyre.errors import ConfigError

DENSE_MODEL_TYPES = ("qwen2", "llama", "qwen3")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTIONS = ("sdpa", "local")


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """Parallel layout and numerics of one cell's Megatron model."""

    tensor_parallel: int = 1
    """Tensor-parallel size inside a cell (divides heads, query groups and the MLP width)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size inside a cell."""
    expert_parallel: int = 1
    """Expert-parallel size inside a cell (mixture-of-experts models): each TP rank of a stage
    holds num_experts / expert_parallel whole routed experts, each split over the
    tensor_parallel / expert_parallel ranks that share them (Megatron's expert tensor
    parallelism; MoE parallel folding: EP x ETP = TP, no expert data parallelism in a cell).
    Divides tensor_parallel."""
    sequence_parallel: bool | None = None
    """Megatron's sequence parallelism (`TransformerConfig.sequence_parallel`): the hidden
    states between the tensor-parallel layers split over the TP ranks along the sequence;
    null: on when tensor_parallel > 1 (`sequence`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter and compute dtype."""
    seed: int = 1234
    """Megatron's model-parallel RNG seed on CUDA (`model_parallel_cuda_manual_seed`: dropout
    and the tracker its attention forks)."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention: "sdpa" (torch's fused kernels, memory linear in the row) or "local"
    (Megatron's `DotProductAttention`, scores materialised: kept for comparisons)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of a mixture-of-experts router's load-balancing loss (Megatron's
    `moe_aux_loss_coeff`, "aux_loss" balancing per micro-batch); 0: none, the gradient is the
    objective's alone. Ignored by dense models."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r}; allowed an integer >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r}; allowed {', '.join(DTYPES)}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention: {self.attention!r}; allowed {', '.join(ATTENTIONS)}")
        if not self.moe_aux_loss_coeff >= 0:
            raise ConfigError(f"moe_aux_loss_coeff: {self.moe_aux_loss_coeff!r}; allowed a "
                              "number >= 0")  # fmt: skip
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("sequence_parallel: true with tensor_parallel 1; allowed with "
                              "tensor_parallel > 1")  # fmt: skip
        if self.tensor_parallel % self.expert_parallel:
            raise ConfigError(expert_divides_tensor(self.expert_parallel, self.tensor_parallel))

    @property
    def sequence(self) -> bool:
        """Whether the model runs sequence parallel: `sequence_parallel`, null resolved to
        tensor_parallel > 1 (the default a GPU run wants: activation memory / TP)."""
        if self.sequence_parallel is None:
            return self.tensor_parallel > 1
        return self.sequence_parallel

    @property
    def expert_tensor_parallel(self) -> int:
        """ETP: the ranks one routed expert is split over (tensor_parallel / expert_parallel)."""
        return self.tensor_parallel // self.expert_parallel

    @property
    def ranks_per_cell(self) -> int:
        """R: ranks one cell holds (TP × PP; data parallelism is across cells)."""
        return self.tensor_parallel * self.pipeline_parallel


def expert_divides_tensor(expert: int, tensor: int) -> str:
    """The one-line refusal of an expert-parallel size that does not divide the TP size."""
    return (f"expert_parallel: {expert} does not divide tensor_parallel {tensor}; allowed: a "
            f"divisor of {tensor} (a cell's experts are folded onto its tensor-parallel ranks: "
            "expert x expert-tensor = tensor)")  # fmt: skip


def model_layers(model: str) -> int | None:
    """The layer count of a model spec, read cheaply (the tiny family's name, a model
    directory's config.json); None where only loading the model would tell."""
    import json
    from pathlib import Path

    from gyre.models import tiny_size

    size = tiny_size(model)
    if size is not None:
        return size[1]
    try:  # a missing or malformed config.json is reported where the model loads
        layers = json.loads((Path(model) / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return layers if isinstance(layers, int) else None


def check_pipeline_split(model: str, pipeline: int) -> None:
    """Refuse a pipeline size that does not divide the model's layers (before any process
    starts; a model whose layer count is not known here is checked where it loads)."""
    layers = model_layers(model) if pipeline > 1 else None
    if layers is not None and layers % pipeline:
        raise ConfigError(
            f"parallel.pipeline: {pipeline} does not divide the {layers} layers of model "
            f"{model!r}; allowed: a pipeline size dividing num_hidden_layers (equal stages)"
        )


def _get(hf: Mapping[str, Any], key: str) -> Any:
    if key not in hf:
        raise ConfigError(f"hf_config.{key}: missing; a {hf.get('model_type')} config.json has it")
    return hf[key]


def qkv_bias(hf: Mapping[str, Any]) -> bool:
    """Whether q/k/v carry biases: Qwen2's always, Qwen2-MoE's unless `qkv_bias` is false,
    others' where `attention_bias` says so."""
    mt = hf.get("model_type")
    if mt == "qwen2":
        return True
    if mt == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def qk_norm(hf: Mapping[str, Any]) -> bool:
    """Whether each head's queries and keys are RMS-normalized (Qwen3's `q_norm` / `k_norm`)."""
    return hf.get("model_type") in QK_NORM_MODEL_TYPES


def num_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer (`num_experts`, or transformers 5's `num_local_experts`
    in a saved Qwen3-MoE config); 0 for a dense model."""
    if hf.get("model_type") not in MOE_MODEL_TYPES:
        return 0
    n = hf.get("num_experts") or hf.get("num_local_experts")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"hf_config.num_experts: {n!r}; allowed an integer >= 1")
    return n


def shared_expert_size(hf: Mapping[str, Any]) -> int:
    """Qwen2-MoE's shared expert width (`shared_expert_intermediate_size`); 0: none."""
    if hf.get("model_type") != "qwen2_moe":
        return 0
    return int(hf.get("shared_expert_intermediate_size") or 0)


def check_hf_config(hf: Mapping[str, Any], cfg: MegatronConfig) -> None:
    """Reject model families and shapes this backend cannot lay out over `cfg`."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"hf_config.model_type: {mt!r}; allowed {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    heads = int(_get(hf, "num_attention_heads"))
    groups = int(hf.get("num_key_value_heads") or heads)
    hidden = int(_get(hf, "hidden_size"))
    tp = cfg.tensor_parallel
    if heads % groups or (not hf.get("head_dim") and hidden % heads):
        raise ConfigError(
            f"hf_config: heads {heads} / kv heads {groups} / hidden {hidden} are inconsistent"
        )
    # a routed expert is split over the expert-tensor ranks, everything else over TP
    width = ("moe_intermediate_size", cfg.expert_tensor_parallel, "expert tensor parallel")
    if not num_experts(hf):
        width = ("intermediate_size", tp, "tensor_parallel")
    for name, value, size, what in (
        ("num_attention_heads", heads, tp, "tensor_parallel"),
        ("num_key_value_heads", groups, tp, "tensor_parallel"),
        (width[0], int(_get(hf, width[0])), width[1], width[2]),
        ("shared_expert_intermediate_size", shared_expert_size(hf), tp, "tensor_parallel"),
    ):
        if value % size:
            raise ConfigError(f"hf_config.{name}: {value} not divisible by {what} {size}")
    layers = int(_get(hf, "num_hidden_layers"))
    if layers % cfg.pipeline_parallel:
        raise ConfigError(
            f"hf_config.num_hidden_layers: {layers} not divisible by "
            f"pipeline_parallel {cfg.pipeline_parallel}"
        )
    if num_experts(hf):
        _check_moe(hf, cfg)
    elif cfg.expert_parallel != 1:
        raise ConfigError(
            f"expert_parallel: {cfg.expert_parallel} for a {mt} model, which has no routed "
            "experts; allowed: 1 (expert parallelism splits a mixture-of-experts model's experts)"
        )


def _check_moe(hf: Mapping[str, Any], cfg: MegatronConfig) -> None:
    """Refuse MoE layouts Megatron's layer does not reproduce here: dense layers among the
    MoE ones, and tensor parallelism without sequence parallelism (megatron-core 0.16's MoE
    layer refuses to train at TP > 1 without it, `MoELayer.forward`)."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ConfigError(
            f"hf_config.decoder_sparse_step / mlp_only_layers: {step!r} / {dense!r}; allowed "
            "1 / [] (every layer a mixture of experts)"
        )
    if cfg.tensor_parallel != 1 and not cfg.sequence:
        raise ConfigError(
            f"sequence_parallel: false at tensor_parallel {cfg.tensor_parallel} for a "
            f"{hf['model_type']} model; allowed: sequence parallelism on (true or null) at "
            "tensor_parallel > 1, or tensor_parallel 1 (megatron-core 0.16's MoE layer trains "
            "at TP > 1 only sequence parallel)"
        )
    if num_experts(hf) % cfg.expert_parallel:
        raise ConfigError(
            f"expert_parallel: {cfg.expert_parallel} does not divide the {num_experts(hf)} "
            f"routed experts of a {hf['model_type']} model; allowed: a divisor of its expert "
            f"count that divides tensor_parallel {cfg.tensor_parallel}"
        )
    top_k = int(_get(hf, "num_experts_per_tok"))
    if not 1 <= top_k <= num_experts(hf):
        raise ConfigError(f"hf_config.num_experts_per_tok: {top_k}; allowed 1..{num_experts(hf)}")
    if top_k == 1 and hf.get("norm_topk_prob"):  # TransformerConfig.__post_init__ refuses it
        raise ConfigError(
            "hf_config.num_experts_per_tok: 1 with norm_topk_prob true; allowed: top-k >= 2, "
            "or norm_topk_prob false (megatron-core refuses a top-1 router that takes its "
            "softmax after the top k)"
        )


def check_trainable(hf: Mapping[str, Any], cfg: MegatronConfig) -> None:
    """Refuse, before any process starts, a model `build_gpt_model` would refuse on the cell's
    ranks: its family, its shapes over `cfg`'s tensor / pipeline sizes and its RoPE (the
    arguments the ranks compute, computed and dropped)."""
    transformer_kwargs(hf, cfg)
    gpt_kwargs(hf)


def transformer_kwargs(hf: Mapping[str, Any], cfg: MegatronConfig) -> dict[str, Any]:
    """`TransformerConfig(**kwargs)` arguments (minus torch objects: see `model.py`)."""
    check_hf_config(hf, cfg)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return {
        "num_layers": int(hf["num_hidden_layers"]),
        "hidden_size": hidden,
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": int(hf.get("head_dim") or hidden // heads),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "gated_linear_unit": True,  # SwiGLU: silu(gate) * up
        "add_bias_linear": False,
        "add_qkv_bias": qkv_bias(hf),
        "qk_layernorm": qk_norm(hf),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_activation_fusion": False,
        "tensor_model_parallel_size": cfg.tensor_parallel,
        "sequence_parallel": cfg.sequence,
        "pipeline_model_parallel_size": cfg.pipeline_parallel,
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        **moe_kwargs(hf, cfg),
    }


def moe_kwargs(hf: Mapping[str, Any], cfg: MegatronConfig) -> dict[str, Any]:
    """The MoE fields of `TransformerConfig` (none for a dense model). HF routes by a
    softmax over all experts, then the top k, renormalized when `norm_topk_prob`; Megatron's
    softmax after the top k (`moe_router_pre_softmax` off) is that renormalized top k, its
    softmax before (on) the plain one. Tokens are dispatched by all-gather (no CUDA-only
    kernels; over the TP x EP ranks, the cell's TP group: `gather_from_sequence_parallel_region`
    and its reduce-scatter, as sequence parallelism's), experts run one after another
    (`SequentialMLP`, no grouped GEMM), each rank its expert-parallel share of them."""
    n = num_experts(hf)
    if not n:
        return {}
    shared = shared_expert_size(hf)
    return {
        "num_moe_experts": n,
        "moe_router_topk": int(hf["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
        "moe_router_pre_softmax": not bool(hf.get("norm_topk_prob", False)),
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": bool(shared),  # Qwen2-MoE: sigmoid(gate(x)) * shared(x)
        "moe_router_load_balancing_type": "aux_loss" if cfg.moe_aux_loss_coeff else "none",
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
        "expert_model_parallel_size": cfg.expert_parallel,
        "expert_tensor_parallel_size": cfg.expert_tensor_parallel,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
    }


def rope_theta(hf: Mapping[str, Any]) -> float:
    """RoPE base: top-level `rope_theta` (transformers 4) or `rope_parameters` (5)."""
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    return float((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def gpt_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`GPTModel` arguments besides config and layer spec."""
    return {
        "vocab_size": int(_get(hf, "vocab_size")),
        "max_sequence_length": int(hf.get("max_position_embeddings", 4096)),
        "position_embedding_type": "rope",
        "rotary_base": int(rope_theta(hf)),
        **rope_scaling_kwargs(hf),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
    }


ROPE_TYPES = ("default", "linear", "llama3")
# Megatron's llama3 scaling (`RotaryEmbedding._apply_scaling`, megatron-core 0.16) is given the
# factor only: the other three parameters stay at these defaults of its signature
# (tests/gpu/test_gpu_megatron_rope.py reads them from Megatron itself).
MEGATRON_LLAMA3 = {
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}  # fmt: skip


def rope_scaling(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The config's RoPE parameters as transformers reads them: `rope_scaling` (transformers
    4's field) when set, else `rope_parameters` (5's); the type under `rope_type` or `type`."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    return params


def rope_scaling_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`GPTModel`'s RoPE scaling arguments reproducing the HF config's rotary frequencies:
    linear → `seq_len_interpolation_factor` (positions / factor, the same angles as HF's
    inv_freq / factor); llama3 → `rope_scaling` with `rope_scaling_factor`. Anything else
    Megatron's `RotaryEmbedding` cannot reproduce is a ConfigError naming the key."""
    params = rope_scaling(hf)
    kind = params["rope_type"]
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(
            f"hf_config.partial_rotary_factor: {partial!r}; allowed 1.0 (the mapped families rotate "
            "the whole head)"
        )
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"hf_config.rope_scaling.rope_type: {kind!r}; allowed {', '.join(ROPE_TYPES)} "
            "(what Megatron's RotaryEmbedding reproduces)"
        )
    if kind == "default":
        return {"rope_scaling": False, "seq_len_interpolation_factor": None}
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise ConfigError(f"hf_config.rope_scaling.factor: {factor!r}; allowed a number > 0")
    if kind == "linear":
        return {"rope_scaling": False, "seq_len_interpolation_factor": float(factor)}
    _check_llama3(hf, params)
    return {"rope_scaling": True, "rope_scaling_factor": float(factor),
            "seq_len_interpolation_factor": None}  # fmt: skip


def _check_llama3(hf: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """Refuse llama3 parameters other than the ones Megatron hard-codes. The original context
    is read as transformers does: the top-level field first, then the rope dict's, then
    max_position_embeddings."""
    given = {
        "low_freq_factor": params.get("low_freq_factor"),
        "high_freq_factor": params.get("high_freq_factor"),
        "original_max_position_embeddings": hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings"),
    }
    for key, fixed in MEGATRON_LLAMA3.items():
        if given[key] != fixed:
            raise ConfigError(
                f"hf_config.rope_scaling.{key}: {given[key]!r}; allowed {fixed} (megatron-core's "
                "llama3 RoPE scaling takes only the factor and fixes this value)"
            )
