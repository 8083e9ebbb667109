"""HF RoPE scaling → Megatron: the mapped `GPTModel` arguments rotate like transformers does.

`gyre.train.megatron.config.rope_scaling_kwargs` maps a Hugging Face config's `rope_scaling`
(transformers 4) or `rope_parameters` (5) to Megatron's `RotaryEmbedding` arguments. Each
case builds Megatron's own `RotaryEmbedding` from the mapped arguments, as `GPTModel` does,
and transformers' own `LlamaRotaryEmbedding` from the same config, and compares the rotation
angles and cos / sin position by position, past the original context where the scaling acts.
Runs on CPU (the angles come from `get_freqs_non_repeated`, which stays on the tensor's
device; only `get_emb` moves to CUDA). Needs megatron-core.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from typing import Any

import pytest
import torch

from gyre.errors import ConfigError
from gyre.train.megatron.config import MEGATRON_LLAMA3, gpt_kwargs

if importlib.util.find_spec("megatron.core") is None:  # imported where used, not at collection
    pytest.skip("megatron-core not installed (extra gyre[gpu])", allow_module_level=True)

BASE = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
    "vocab_size": 32, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}  # fmt: skip
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
CASES = {
    "default": {**BASE, "rope_theta": 10000.0},
    "llama3.1 (transformers 4)": {**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA31},
    "llama3.2 (transformers 5)": {
        **BASE, "rope_parameters": {**LLAMA31, "factor": 32.0, "rope_theta": 500000.0},
    },
    "linear (legacy `type`)": {
        **BASE, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0},
    },
    "linear (transformers 5)": {
        **BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 1e6},
    },
}  # fmt: skip
POSITIONS = torch.tensor([0, 1, 7, 100, 1000, 8191, 8192, 20000, 65000, 131071])


def _megatron_rotary(hf: dict[str, Any]) -> Any:
    """Megatron's RotaryEmbedding with the arguments `GPTModel.__init__` passes it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_model import GPTModel

    gk = gpt_kwargs(hf)
    accepted = inspect.signature(GPTModel.__init__).parameters
    assert set(gk) <= set(accepted), set(gk) - set(accepted)  # GPTModel(**gk) takes them all
    return RotaryEmbedding(
        kv_channels=hf["hidden_size"] // hf["num_attention_heads"],
        rotary_percent=1.0,
        seq_len_interpolation_factor=gk["seq_len_interpolation_factor"],
        rotary_base=gk["rotary_base"],
        rope_scaling=gk["rope_scaling"],
        rope_scaling_factor=gk.get("rope_scaling_factor", accepted["rope_scaling_factor"].default),
        use_cpu_initialization=True,
    )


def _megatron_angles(hf: dict[str, Any]) -> torch.Tensor:
    """[position, dim / 2] rotation angles of Megatron at POSITIONS."""
    freqs = _megatron_rotary(hf).get_freqs_non_repeated(int(POSITIONS.max()) + 1)
    assert freqs.device.type == "cpu"
    return freqs[POSITIONS].double()


def _hf_rotary(hf: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' LlamaRotaryEmbedding: (angles [position, dim / 2], cos, sin)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == 1.0  # Megatron has no cos / sin scale
    angles = torch.outer(POSITIONS.double(), rotary.inv_freq.double())
    x = torch.zeros(1, len(POSITIONS), 1)
    cos, sin = rotary(x, POSITIONS[None])
    half = angles.shape[1]
    assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # rotate-half layout, as Megatron's
    return angles, cos[0, :, :half].double(), sin[0, :, :half].double()


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_rotary_matches_transformers(name: str) -> None:
    hf = CASES[name]
    ours = _megatron_angles(hf)
    angles, cos, sin = _hf_rotary(hf)
    # float32 angles of up to ~1e5 rad: relative to the angle (measured: <= 1.4e-7), and
    # cos / sin to their float32 rounding at such angles (measured: <= 9e-5, linear 2.5)
    torch.testing.assert_close(ours, angles, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.cos(), cos, rtol=0, atol=2e-4)
    torch.testing.assert_close(ours.sin(), sin, rtol=0, atol=2e-4)


@pytest.mark.parametrize("name", [n for n in CASES if n != "default"])
def test_scaling_changes_the_angles(name: str) -> None:
    """The cases exercise the scaling: unscaled angles differ from the scaled ones (llama3:
    in all three bands, long wavelengths divided, short ones kept, the middle smoothed)."""
    hf = CASES[name]
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    params = hf.get("rope_scaling") or hf["rope_parameters"]
    plain["rope_theta"] = hf.get("rope_theta") or params["rope_theta"]
    scaled, unscaled = _megatron_angles(hf)[-1], _megatron_angles(plain)[-1]
    ratio = unscaled[1:] / scaled[1:]
    factor = params["factor"]
    if params.get("rope_type", params.get("type")) == "linear":
        torch.testing.assert_close(ratio, torch.full_like(ratio, factor))
    else:
        assert math.isclose(ratio[0], 1.0) and math.isclose(ratio[-1], factor)
        assert ((ratio > 1.0 + 1e-6) & (ratio < factor - 1e-6)).any()


def test_llama3_constants_are_megatrons_own() -> None:
    """The values Gyre accepts for llama3 are the defaults Megatron's scaling keeps."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    defaults = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    assert {k: defaults[k].default for k in MEGATRON_LLAMA3} == MEGATRON_LLAMA3
    init = inspect.getsource(RotaryEmbedding.__init__)
    assert "self._apply_scaling(self.inv_freq, factor=rope_scaling_factor)" in init


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
         "rope_type: 'yarn'; allowed default, linear, llama3"),
        ({"type": "dynamic", "factor": 2.0}, "rope_type: 'dynamic'"),
        ({**LLAMA31, "original_max_position_embeddings": 4096},
         "original_max_position_embeddings: 4096; allowed 8192"),
        ({**LLAMA31, "high_freq_factor": 2.0}, "high_freq_factor: 2.0; allowed 4.0"),
        ({**LLAMA31, "factor": "8"}, "factor: '8'; allowed a number > 0"),
        ({"rope_type": "linear"}, "factor: None"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor: 0.5"),
    ],
)  # fmt: skip
def test_unreproducible_rope_is_refused_by_name(rope: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        gpt_kwargs({**BASE, "rope_theta": 10000.0, "rope_scaling": rope})
    with pytest.raises(ConfigError, match=match):  # transformers 5's field alike
        gpt_kwargs({**BASE, "rope_parameters": {**rope, "rope_theta": 1e4}})


def test_llama3_original_context_read_like_transformers() -> None:
    """Without `original_max_position_embeddings` in the rope dict transformers falls back to
    max_position_embeddings (a top-level field wins over both)."""
    rope = {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}
    with pytest.raises(ConfigError, match="original_max_position_embeddings: 131072"):
        gpt_kwargs({**BASE, "rope_theta": 1e4, "rope_scaling": rope})
    hf = {**BASE, "rope_theta": 1e4, "rope_scaling": rope, "max_position_embeddings": 8192}
    assert gpt_kwargs(hf)["rope_scaling"] is True
    top = {**BASE, "rope_theta": 1e4, "rope_scaling": LLAMA31,
           "original_max_position_embeddings": 4096}  # fmt: skip
    with pytest.raises(ConfigError, match="original_max_position_embeddings: 4096"):
        gpt_kwargs(top)


def test_gyre_built_model_carries_the_scaling(megatron_world: None) -> None:
    """`build_gpt_model` (the backend's own builder) gives its RotaryEmbedding the scaling."""
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import build_gpt_model

    hf = CASES["llama3.1 (transformers 4)"]
    model = build_gpt_model(hf, MegatronConfig(dtype="float32"), device="cpu")
    angles, _, _ = _hf_rotary(hf)
    inv = model.rotary_pos_emb.inv_freq.double()  # type: ignore[union-attr]
    torch.testing.assert_close(torch.outer(POSITIONS.double(), inv), angles, rtol=2e-6, atol=0)
    linear = build_gpt_model(CASES["linear (legacy `type`)"], MegatronConfig(), device="cpu")
    assert linear.rotary_pos_emb.seq_len_interpolation_factor == 4.0  # type: ignore[union-attr]
