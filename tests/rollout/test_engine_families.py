"""The embedded engine serves Qwen3 and Qwen3-MoE models (issue 54, item 3, the embedded part).

A tiny random model of each family (transformers' own class, from a config in code, with the
tiny tokenizer's vocabulary), saved as a model directory and loaded the way `gyre run` loads
one (`Engine.load`: `load_model` + `check_batchable`, the KV-cache check). Two greedy requests
of different lengths run batched through the engine's KV cache; each generated token is the
argmax of a plain, uncached forward over the whole context, and its reported log-prob that
forward's log-softmax.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gyre.errors import ProtocolError
from gyre.models import tiny_tokenizer
from gyre.rollout import weights
from gyre.rollout.engine import Config, Engine
from gyre.rollout.protocol import GenerateRequest, SamplingParams

from .reference import reference_logits


def _save_tiny(kind: str, folder: Path) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = tiny_tokenizer()
    common = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 12, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.pad_token_id}  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4,
                                                   num_experts_per_tok=2, norm_topk_prob=True,
                                                   **common))  # fmt: skip
    with torch.no_grad():  # transformers' init is near zero: make every weight matter
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.float().eval()


def _greedy(engine: Engine, rid: str, ids: list[int], n: int, out: dict[str, Any],
            done: threading.Event) -> None:  # fmt: skip
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    def deliver(body: dict[str, Any]) -> None:
        out[rid] = body
        if len(out) == 2:
            done.set()

    engine.submit(GenerateRequest(rid=rid, input_ids=ids, sampling=sp, return_logprob=True),
                  deliver)  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_the_embedded_engine_serves_a_family(tmp_path: Path, kind: str) -> None:
    model = _save_tiny(kind, tmp_path)
    engine = Engine.load(Config(model=str(tmp_path)))
    assert type(engine.model).__name__ == type(model).__name__
    prompts = {"a": [5, 17, 300, 42, 9, 77, 1000], "b": [250, 3, 8]}
    out: dict[str, Any] = {}
    done = threading.Event()
    for rid, ids in prompts.items():  # queued before the loop starts: one batch
        _greedy(engine, rid, ids, 6, out, done)
    engine.start()
    try:
        assert done.wait(timeout=120), "the engine did not answer"
    finally:
        engine.stop()
    for rid, ids in prompts.items():
        body = out[rid]
        assert body["meta_info"]["finish_reason"]["type"] == "length", body
        got = body["output_ids"]
        assert len(got) == 6
        for k, row in enumerate(reference_logits(model, ids, got)):
            logits = torch.tensor(row)
            assert got[k] == int(logits.argmax())
            want = float(torch.log_softmax(logits, -1)[got[k]])
            assert body["meta_info"]["output_token_logprobs"][k][0] == pytest.approx(want,
                                                                                     abs=1e-4)  # fmt: skip


def test_a_saved_moe_policy_loads_into_the_embedded_engine(tmp_path: Path) -> None:
    """A mixture-of-experts policy as `save_policy` writes it and `policies.load_weights`
    reads it back (checkpoint names: one tensor per expert and projection, what a cell's
    engine reload sends) loads into the embedded engine, which holds the experts stacked:
    afterwards it holds exactly the policy's weights. (The engine refused those names with a
    400, failing a Qwen3-MoE run at its first reload.)"""
    from gyre.runtime.shared import policies

    _save_tiny("qwen3_moe", tmp_path / "base")
    engine = Engine.load(Config(model=str(tmp_path / "base")))
    policy = _save_tiny("qwen3_moe", tmp_path / "other")  # seed 0 again: perturb it
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape))
    saved = policies.save_policy(tmp_path / "run", "v00001", policy, tiny_tokenizer(), version=1)
    named = policies.load_weights(saved)
    assert any(".mlp.experts.1.up_proj.weight" in n for n, _ in named)  # checkpoint names
    engine._updating = True  # between /begin_weight_update and /end_weight_update
    assert engine.update_weights(named, "1") == "1"
    mine = dict(engine.model.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.equal(mine[name], p), name
    expert = [(n, t) for n, t in named if n.endswith("experts.0.down_proj.weight")][:1]
    with pytest.raises(ProtocolError, match=r"experts\.0\.down_proj\.weight': shape"):
        weights.load_named_tensors(engine.model, [(expert[0][0], expert[0][1][:1])])
