"""The proxy records each call's routed experts in its node (issue 54, item 4, routing replay).

A tiny random Qwen3-MoE served by the embedded engine (a real `gyre engine` process, over
HTTP) behind a proxy that asks for routing (`ProxyService.routing_top_k`, what a run sets from
`train.routing_replay`); an agent makes two calls through the official openai SDK, the second
continuing the first. Each node's rows are the experts the model's own routers choose, in
an uncached forward over the node's path, for the position before each of the node's tokens
(the first node's first row -1: nothing precedes it), so the path's routing
(`PathTokens.routing`) is every position's. A proxy that does not ask records none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openai
import torch
from conftest import MODEL

from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.rollout.routed import RouterTap
from gyre.rollout.testing import running_engine


def _tiny_moe(folder: Path) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gyre.models import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=2, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    ))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.float().eval()


def _chat(proxy: Any, execution: str) -> None:
    key = proxy.call(proxy.app.register_execution, execution, "main")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": "Count."}]
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                 {"role": "user", "content": "More."}]  # fmt: skip


def test_each_node_records_the_routing_of_the_positions_before_its_tokens(tmp_path: Path) -> None:
    model = _tiny_moe(tmp_path)
    tap = RouterTap.of_model(model)
    assert tap is not None
    with running_engine(str(tmp_path)) as url, running_proxy(
        {"e0": url}, tokenizer=_tokenizer(), config=Config(model_names=[MODEL])
    ) as proxy:  # fmt: skip
        proxy.call(setattr, proxy.app.service, "routing_top_k", 2)
        _chat(proxy, "moe")
        proxy.call(setattr, proxy.app.service, "routing_top_k", 0)
        _chat(proxy, "dense-view")
        tree = proxy.call(proxy.app.tree, "moe")
        unasked = proxy.call(proxy.app.tree, "dense-view")
    assert len(tree) == 2 and tree.node(2).parent_id == 1
    assert all(n.routed_experts is None for n in unasked.nodes)
    path = tree.materialize(2)
    with torch.no_grad():
        model(input_ids=torch.tensor([path.ids.tolist()]), use_cache=False)
    want = tap.take(rows=1)[0]  # [positions, layers, top_k]
    got = path.routing
    assert got is not None and got.shape == want.shape
    assert (got[-1] == -1).all()  # the last position predicts nothing
    same = np.sort(got[:-1], axis=-1) == np.sort(want[:-1], axis=-1)
    assert same.all(), f"positions {np.nonzero(~same.all(axis=(1, 2)))[0][:10]} differ"
    first = tree.node(1).routed_experts
    assert first is not None and (first[0] == -1).all()


def _tokenizer() -> Any:
    from gyre.models import tiny_tokenizer

    return tiny_tokenizer()
