"""`SDPAttention` (gyre/train/megatron/attention.py) against Megatron's own `DotProductAttention`,
the core attention of the local layer spec Gyre used before: the same outputs and gradients
for the same query / key / value tensors (grouped-query shapes, explicit mask or none), the
same log-probs and gradients of a whole `MegatronCell` step, and no `len x len` tensor on the
way (a dispatch mode sees every op's output, backward included). On CPU, TP = 1; TP = 2 is
test_gpu_megatron_cpu.py's."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gyre.train.packing import MicroStep
from gyre.train.synthetic import random_step

if importlib.util.find_spec("megatron.core") is None:  # imported where used, not at collection
    pytest.skip("megatron-core not installed (extra gyre[gpu])", allow_module_level=True)

HF = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
      "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
      "vocab_size": 64, "tie_word_embeddings": True}  # fmt: skip


def _attentions(heads: int, groups: int, head_dim: int) -> tuple[Any, Any]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gyre.train.megatron.attention import SDPAttention

    tc = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                           num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                           use_cpu_initialization=True)  # fmt: skip
    args = {"config": tc, "layer_number": 1, "attn_mask_type": AttnMaskType.causal,
            "attention_type": "self"}  # fmt: skip
    return DotProductAttention(**args), SDPAttention(**args)


@pytest.mark.parametrize("seq,batch,heads,groups,head_dim",
                         [(1, 1, 2, 2, 8), (9, 3, 4, 2, 8), (33, 2, 6, 1, 16), (16, 1, 4, 4, 4)])  # fmt: skip
def test_sdpa_matches_megatrons_dot_product_attention(
    megatron_world: None, seq: int, batch: int, heads: int, groups: int, head_dim: int
) -> None:
    """Outputs ([s, b, np * hn]) and query / key / value gradients agree to float32 rounding,
    with Megatron's causal mask given to both, or none given to SDPAttention."""
    local, sdpa = _attentions(heads, groups, head_dim)
    gen = torch.Generator().manual_seed(seq * 100 + heads)
    q0 = torch.randn(seq, batch, heads, head_dim, generator=gen)
    k0, v0 = (torch.randn(seq, batch, groups, head_dim, generator=gen) for _ in range(2))
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]  # True = masked out
    weights = torch.randn(seq, batch, heads * head_dim, generator=gen)

    def run(attention: Any, m: torch.Tensor | None) -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attention(q, k, v, m, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None)  # fmt: skip
        (out * weights).sum().backward()
        return [out.detach(), *(t.grad for t in (q, k, v))]

    want = run(local, mask)
    for m in (None, mask):
        got = run(sdpa, m)
        assert got[0].shape == (seq, batch, heads * head_dim)
        for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
            assert torch.allclose(g, w, atol=2e-6, rtol=1e-5), (name, float((g - w).abs().max()))


def _step(lengths: tuple[int, ...]) -> MicroStep:
    return random_step(np.random.default_rng(0), lengths, vocab=HF["vocab_size"], first_target=1)


def _cell(attention: str, weights: dict[str, torch.Tensor] | None = None) -> Any:
    from gyre.train.config import ObjectiveConfig
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model

    cfg = MegatronConfig(dtype="float32", attention=attention)  # type: ignore[arg-type]
    if weights is None:  # a random model of HF's shape
        from gyre.train.megatron.model import build_gpt_model

        shapes = build_gpt_model(HF, cfg, device="cpu").state_dict()
        gen = torch.Generator().manual_seed(1)
        weights = {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in shapes.items()
                   if not k.endswith("_extra_state")}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_rank_model(HF, weights, cfg, device="cpu")
    return MegatronCell(model, objective=ObjectiveConfig()), weights


def _pass(cell: Any, step: MicroStep) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logp, st = cell._logprobs(step, grad=True)
    cell._backward((logp * st.targets).sum())
    return logp.detach(), {n: p.grad.clone() for n, p in cell.model.named_parameters()}


def test_a_megatron_cell_step_is_the_same_with_either_attention(megatron_world: None) -> None:
    """The whole model (two layers, grouped-query attention, right-padded rows): target
    log-probs and every parameter's gradient, SDPAttention (no mask tensor passed) against
    DotProductAttention (Megatron's causal mask)."""
    step = _step((17, 9, 12))
    local, weights = _cell("local")
    sdpa, _ = _cell("sdpa", weights)
    assert local._explicit_mask and not sdpa._explicit_mask
    want_logp, want_grads = _pass(local, step)
    got_logp, got_grads = _pass(sdpa, step)
    assert torch.allclose(got_logp, want_logp, atol=2e-6)
    for name, g in got_grads.items():
        w = want_grads[name]
        assert float((g - w).norm()) <= 1e-5 * float(w.norm()) + 1e-7, name


class _Quadratic(TorchDispatchMode):
    """Shapes of every op output with at least `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, list[tuple[str, tuple[int, ...]]]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_no_len_by_len_tensor_with_sdpa(megatron_world: None, attention: str) -> None:
    """A 256-token row's forward + backward through the cell: with SDPAttention no op output
    holds len x len / 2 elements or more (the largest tensors are len x vocab); Megatron's
    DotProductAttention makes its mask, scores and probabilities (the check fails it)."""
    width = 256
    step = _step((width,))
    cell, _ = _cell(attention)
    big = _Quadratic(width * width // 2)
    with big:
        _pass(cell, step)
    if attention == "sdpa":
        assert big.seen == []
    else:
        assert any(shape[-2:] == (width, width) for _, shape in big.seen)
