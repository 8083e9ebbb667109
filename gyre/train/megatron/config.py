"""Typed configuration of the Megatron-core backend and the HF config → TransformerConfig map.

Torch-free, so CLI modules and config loading can import it. `transformer_kwargs(hf)` turns a
Hugging Face Qwen2 / Llama `config.json` (a dict) into the keyword arguments of
`megatron.core.transformer.TransformerConfig` plus the `GPTModel` arguments (`gpt_kwargs`):

    cfg = MegatronConfig(tensor_parallel=2, dtype="bfloat16")
    tk, gk = transformer_kwargs(hf_config, cfg), gpt_kwargs(hf_config)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gyre.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """Parallel layout and numerics of one cell's Megatron model."""

    tensor_parallel: int = 1
    """Tensor-parallel size inside a cell (divides heads, query groups and the MLP width)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size inside a cell."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter and compute dtype."""
    seed: int = 1234
    """Model-parallel RNG seed (random init)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r}; allowed an integer >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r}; allowed {', '.join(DTYPES)}")

    @property
    def ranks_per_cell(self) -> int:
        """R: ranks one cell holds (TP × PP; data parallelism is across cells)."""
        return self.tensor_parallel * self.pipeline_parallel


def _get(hf: Mapping[str, Any], key: str) -> Any:
    if key not in hf:
        raise ConfigError(f"hf_config.{key}: missing; a Qwen2/Llama config.json has it")
    return hf[key]


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
    if heads % groups or hidden % heads:
        raise ConfigError(
            f"hf_config: heads {heads} / kv heads {groups} / hidden {hidden} are inconsistent"
        )
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", groups),
        ("intermediate_size", int(_get(hf, "intermediate_size"))),
    ):
        if value % tp:
            raise ConfigError(f"hf_config.{name}: {value} not divisible by tensor_parallel {tp}")
    layers = int(_get(hf, "num_hidden_layers"))
    if layers % cfg.pipeline_parallel:
        raise ConfigError(
            f"hf_config.num_hidden_layers: {layers} not divisible by "
            f"pipeline_parallel {cfg.pipeline_parallel}"
        )


def transformer_kwargs(hf: Mapping[str, Any], cfg: MegatronConfig) -> dict[str, Any]:
    """`TransformerConfig(**kwargs)` arguments (minus torch objects: see `model.py`)."""
    check_hf_config(hf, cfg)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    qkv_bias = hf["model_type"] == "qwen2" or bool(hf.get("attention_bias", False))
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
        "add_qkv_bias": qkv_bias,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_activation_fusion": False,
        "tensor_model_parallel_size": cfg.tensor_parallel,
        "pipeline_model_parallel_size": cfg.pipeline_parallel,
        "init_method_std": float(hf.get("initializer_range", 0.02)),
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
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
    }
