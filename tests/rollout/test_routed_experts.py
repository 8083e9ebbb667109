"""The embedded engine reports the experts a mixture-of-experts model routed each position to
(issue 54, item 4: SGLang 0.5.21's `return_routed_experts`, `routed_experts_start_len`,
`meta_info.routed_experts` as base64 int32 `[positions, layers, top_k]`).

A tiny random Qwen3-MoE serves two greedy calls batched through its KV cache, then a third
that extends the first call's whole context (its prefix comes from the prefix cache), asked
from position 0 and from the first call's last token. Every
reported row equals the top-k of the model's own router in a plain, uncached forward over
the whole sequence (as sets: the order of equal-scored experts is the kernel's), the cached
positions' rows included (kept with the prefix cache's KV). The client decodes them
(`GenerateResult.routed_experts`), and a node's rows get their -1 first row under the root.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gyre.errors import ProtocolError
from gyre.models import tiny_tokenizer
from gyre.rollout import routed
from gyre.rollout.engine import Config, Engine
from gyre.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams, parse_generate

from .test_engine_families import _save_tiny


def _call(engine: Engine, rid: str, ids: list[int], n: int, start: int | None) -> threading.Event:
    done = threading.Event()
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    req = GenerateRequest(rid=rid, input_ids=ids, sampling=sp, return_logprob=True,
                          return_routed_experts=start is not None,
                          routed_experts_start_len=start or 0)  # fmt: skip

    def deliver(body: dict[str, Any]) -> None:
        OUT[rid] = body
        done.set()

    engine.submit(req, deliver)
    return done


OUT: dict[str, dict[str, Any]] = {}


def _reference(model: Any, ids: list[int]) -> np.ndarray:
    """The router's top-k of every position of `ids`, in one uncached forward."""
    tap = routed.RouterTap.of_model(model)
    assert tap is not None
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    return tap.take(rows=1)[0]


def _same_sets(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all())


def test_the_engine_reports_each_positions_routed_experts(tmp_path: Path) -> None:
    model = _save_tiny("qwen3_moe", tmp_path)
    engine = Engine.load(Config(model=str(tmp_path)))
    prompts = {"a": [5, 17, 300, 42, 9, 77, 1000], "b": [250, 3, 8, 11, 12]}
    OUT.clear()
    waits = [_call(engine, rid, ids, 6, 0) for rid, ids in prompts.items()]  # one batch
    engine.start()
    try:
        assert all(w.wait(timeout=120) for w in waits), "the engine did not answer"
        a = prompts["a"] + OUT["a"]["output_ids"]
        assert _call(engine, "c", [*a, 44, 45], 3, 0).wait(timeout=120)
        assert _call(engine, "d", [*a, 44, 45], 3, len(a) - 1).wait(timeout=120)
    finally:
        engine.stop()
    assert OUT["c"]["meta_info"]["cached_tokens"] >= 4, "the third call reused no prefix"
    for rid, ids in prompts.items():
        body = OUT[rid]
        full = ids + body["output_ids"]
        got = GenerateResult.from_response(body, routed_from=0).routed_experts
        assert got is not None and got.shape == (len(full) - 1, 2 * 2)  # 2 layers x top 2
        ref = _reference(model, full)[: len(full) - 1]
        assert _same_sets(got.reshape(ref.shape), ref), f"call {rid}: not the router's choice"
    for rid, start in (("c", 0), ("d", len(a) - 1)):  # from the start; from a's last token
        full = a + [44, 45] + OUT[rid]["output_ids"]
        got = GenerateResult.from_response(OUT[rid], routed_from=start).routed_experts
        assert got is not None
        ref = _reference(model, full)[start : len(full) - 1]
        assert _same_sets(got.reshape(ref.shape), ref), f"call {rid}: not the router's choice"


def test_a_nodes_rows_start_with_an_unknown_row_under_the_root() -> None:
    rows = np.arange(12, dtype=np.int32).reshape(3, 4)  # 3 positions, 2 layers x top 2
    under_root = routed.node_rows(rows, 2, at_root=True)
    assert under_root.dtype == np.int16 and under_root.shape == (4, 2, 2)
    assert (under_root[0] == -1).all() and (under_root[1:].reshape(3, 4) == rows).all()
    assert routed.node_rows(rows, 2, at_root=False).shape == (3, 2, 2)
    with pytest.raises(ProtocolError, match="whole top-3"):
        routed.node_rows(rows, 3, at_root=False)


def test_the_wire_format_is_sglangs() -> None:
    rows = np.array([[1, 2, 3, 0], [2, 1, 0, 3]], np.int32)
    text = routed.encode(rows)
    assert np.frombuffer(__import__("base64").b64decode(text), np.int32).tolist() == [
        1, 2, 3, 0, 2, 1, 0, 3,
    ]  # fmt: skip
    assert (routed.decode(text, 2) == rows).all()
    with pytest.raises(ProtocolError, match="do not split into 3 positions"):
        routed.decode(text, 3)
    with pytest.raises(ProtocolError, match="not base64"):
        routed.decode("@@@", 1)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("return_routed_experts", "yes", "return_routed_experts: 'yes'; allowed: true or false"),
        ("routed_experts_start_len", 9, "routed_experts_start_len: 9; allowed: 0..3"),
        ("routed_experts_start_len", -1, "routed_experts_start_len: -1; allowed: 0..3"),
        ("routed_experts_start_len", 1.5, "routed_experts_start_len: 1.5; allowed: an integer"),
    ],
)
def test_a_bad_routed_experts_field_is_refused(field: str, value: Any, message: str) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, field: value}
    with pytest.raises(ProtocolError) as e:
        parse_generate(body, vocab_size=len(tiny_tokenizer()))
    assert str(e.value).startswith(message)
