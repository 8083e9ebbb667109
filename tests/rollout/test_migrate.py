"""KV-cache migration on reroute between two real engines (paper §4.3).

The cell's switch to TRAIN runs `migrate_kv(source, {execution rid prefix: destination})`
and then aborts the source's calls; the proxy retries each aborted call with the same input
at the destination. These tests drive exactly that sequence and check what a user relies
on: the retried call is served from the migrated KV (`cached_tokens`), its greedy tokens and
behaviour log-probs equal a recompute from scratch (and the slow reference), the source
keeps no pins afterwards, and every failure (other weights, a dead destination, a lapsed
pin, a source without the routes) leaves the call to be recomputed.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gyre.errors import ProtocolError
from gyre.rollout import kvstore
from gyre.rollout.client import EngineClient
from gyre.rollout.kvmigrate import Migration, execution_prefix, migrate_kv
from gyre.rollout.protocol import GenerateResult, KVSegment, SamplingParams, parse_kv_pin
from gyre.rollout.serving.config import ServerConfig, hicache_shared_l3
from gyre.rollout.testing import running_engine

from .conftest import run
from .reference import reference_logits, slow_distribution

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=20_000, temperature=0.0, ignore_eos=True)
LOGPROB_TOL = 1e-5  # migrated vs recomputed KV: the same numbers up to float rounding


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[str, str]]:
    """Source and destination engines (tiny model, same weights, version "0")."""
    with running_engine("tiny") as source, running_engine("tiny") as destination:
        yield source, destination


@pytest.fixture(scope="module")
def context(tiny: Any) -> list[int]:
    """A ~600-token agent-like context."""
    _, tok = tiny
    turns = [{"role": "user", "content": f"Step {i}: list the files and fix test_{i}."}
             for i in range(30)]  # fmt: skip
    text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def _running(client: EngineClient, ids: list[int], rid: str) -> asyncio.Future[Any]:
    """Start a long call and return once the engine decodes it (its prompt is prefilled)."""
    call = asyncio.ensure_future(client.generate(ids, LONG, rid))
    while (await client.stats())["running"] == 0:
        await asyncio.sleep(0.02)
    return call


async def _reroute(
    source: str, dest: str, ids: list[int], execution: str, transport: str = "auto"
) -> tuple[Migration, GenerateResult, GenerateResult]:
    """The switch as the cell and the proxy run it: migrate, abort all, retry at dest."""
    src = EngineClient(source)
    call = await _running(src, ids, f"{execution}-3-ab12-1")
    loop = asyncio.get_running_loop()
    routes = {execution_prefix(execution): dest}
    done = await loop.run_in_executor(None, lambda: migrate_kv(source, routes, transport=transport))
    await src.abort_all()
    aborted = await call
    retried = await EngineClient(dest).generate(ids, GREEDY, f"{execution}-3-ab12-2")
    return done[execution_prefix(execution)], aborted, retried


async def _recompute(dest: str, ids: list[int]) -> GenerateResult:
    client = EngineClient(dest)
    await client.flush_cache()
    result = await client.generate(ids, GREEDY, "recompute")
    await client.flush_cache()
    return result


@pytest.mark.parametrize("transport", ["http", "mooncake"])
def test_migrated_continuation_equals_recompute(
    pair: tuple[str, str], context: list[int], tiny: Any, transport: str
) -> None:
    if transport == "mooncake":
        pytest.importorskip(
            "mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda"
        )
    source, dest = pair
    fresh = run(_recompute(dest, context))
    assert fresh.cached_tokens == 0
    migration, aborted, retried = run(
        _reroute(source, dest, context, f"g1-e{transport}", transport)
    )

    assert migration.outcome == "migrated", migration.error
    assert (migration.segments, migration.tokens, migration.transport) == (
        1,
        len(context),
        transport,
    )
    assert aborted.finish_type == "abort"
    assert retried.cached_tokens == len(context) - 1  # served from the migrated KV
    assert retried.output_ids == fresh.output_ids
    np.testing.assert_allclose(
        retried.output_logprobs, fresh.output_logprobs, atol=LOGPROB_TOL, rtol=0
    )
    model, _ = tiny
    for k, row in enumerate(reference_logits(model, context, retried.output_ids)):
        policy = slow_distribution(row, 1.0, 1.0)  # the behaviour log-prob: raw logits, T = 1
        assert retried.output_logprobs[k] == pytest.approx(policy[retried.output_ids[k]], abs=1e-4)
    kv = run(EngineClient(source).stats())["kv_migration"]
    assert (kv["pinned"], kv["pinned_bytes"]) == (0, 0)  # released after the acknowledgement


def test_an_execution_between_calls_migrates_its_cached_context(
    pair: tuple[str, str], context: list[int]
) -> None:
    """No call in flight: the prefix cache entry its last call left moves, and only its."""
    source, dest = pair
    src, dst = EngineClient(source), EngineClient(dest)
    run(dst.flush_cache())
    last = run(src.generate(context, GREEDY, "g2-e1-4-cd34-1"))
    elsewhere = context[300:]  # another execution's context, not a prefix of this one
    run(src.generate(elsewhere, GREEDY, "g2-e10-2-ef56-1"))
    done = migrate_kv(source, {execution_prefix("g2-e1"): dest})["g2-e1-"]
    assert (done.outcome, done.segments) == ("migrated", 1), done.error
    assert done.tokens == len(context) + len(last.output_ids) - 1  # all but the last sample
    following = [*context, *last.output_ids, 2, 1, 7, 9, 11]  # the next turn extends it
    served = run(dst.generate(following, GREEDY, "g2-e1-5-aa11-1"))
    assert served.cached_tokens == done.tokens
    other = run(dst.generate(elsewhere, GREEDY, "g2-e10-3-bb22-1"))
    assert other.cached_tokens == 0  # g2-e10's KV stayed at the source


@pytest.mark.slow
def test_any_failure_falls_back_to_recompute(
    pair: tuple[str, str], context: list[int], tiny: Any
) -> None:
    source, dest = pair
    src, dst = EngineClient(source), EngineClient(dest)
    run(src.generate(context, GREEDY, "g3-e1-1-aa-1"))
    dead = "http://127.0.0.1:9"
    assert migrate_kv(source, {"nobody-": dest})["nobody-"].outcome == "none"
    gone = migrate_kv(source, {"g3-e1-": dead}, timeout=5)["g3-e1-"]
    assert gone.outcome == "failed" and "cannot connect" in gone.error
    no_routes = migrate_kv(source + "/sglang-like", {"g3-e1-": dest})["g3-e1-"]
    assert no_routes.outcome == "unsupported"  # what real SGLang answers (no /gyre/kv/*)

    named = list(tiny[0].state_dict().items())[:1]
    run(dst.update_weights_from_tensor(named, "7"))  # the same weights, another version
    try:
        other = migrate_kv(source, {"g3-e1-": dest})["g3-e1-"]
        assert other.outcome == "failed" and "weight_version '0'" in other.error
        retried = run(dst.generate(context, GREEDY, "g3-e1-1-aa-2"))
        assert retried.cached_tokens == 0 and retried.finish_type == "length"  # recomputed
    finally:
        run(dst.update_weights_from_tensor(named, "0"))
    kv = run(src.stats())["kv_migration"]
    assert kv["pinned"] == 0  # every failed handoff released its pins too


def test_a_lapsed_or_released_pin_cannot_be_read(pair: tuple[str, str], context: list[int]) -> None:
    source, dest = pair
    src, dst = EngineClient(source), EngineClient(dest)
    run(src.generate(context, GREEDY, "g4-e1-1-aa-1"))
    segments = run(src.kv_pin(rid_prefixes=["g4-e1-"], ttl_s=0.2))
    time.sleep(0.4)
    ack = run(dst.kv_import(source, segments, transport="http"))
    assert not ack.imported and "404" in ack.failed[0]["error"]
    segments = run(src.kv_pin(rids=["g4-e1-1-aa-1"]))
    assert [s.rid for s in segments] == ["g4-e1-1-aa-1"]
    assert run(src.kv_release([s.handle for s in segments])) == 1
    assert run(src.kv_release([s.handle for s in segments])) == 0
    ack = run(dst.kv_import(source, segments, transport="http"))
    assert not ack.imported and ack.failed[0]["rid"] == "g4-e1-1-aa-1"


def test_bad_kv_bodies_get_400_naming_the_field(pair: tuple[str, str]) -> None:
    source, _ = pair
    for route, body, field in [
        ("/gyre/kv/pin", {}, "rid_prefixes"),
        ("/gyre/kv/pin", {"rids": ["x"], "ttl_s": -1}, "ttl_s"),
        ("/gyre/kv/pin", {"rid_prefix": ["x"]}, "rid_prefix"),
        ("/gyre/kv/import", {"source": "nowhere", "segments": []}, "source"),
        ("/gyre/kv/import", {"source": source, "segments": [{"handle": 1}]}, "segments[]"),
        ("/gyre/kv/release", {"handles": [3]}, "handles"),
    ]:
        req = urllib.request.Request(source + route, data=json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        assert field in e.value.read().decode()


def test_pack_round_trips_and_select_keeps_the_longest(tiny: Any) -> None:
    layers = [(torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)) for _ in range(2)]
    tokens = list(range(100, 106))
    buf = kvstore.pack(tokens, [(k[:, :, :6], v[:, :, :6]) for k, v in layers])
    seg = KVSegment(handle="00", selector="a-", rid="a-1", tokens=6, nbytes=buf.nbytes, layers=2,
                    heads=2, head_dim=16, dtype="float32", model="tiny", weight_version="0")  # fmt: skip
    got_tokens, got = kvstore.unpack(buf, seg)
    assert got_tokens.tolist() == tokens
    for (k, v), (gk, gv) in zip(layers, got, strict=True):
        assert torch.equal(gk, k[:, :, :6]) and torch.equal(gv, v[:, :, :6])
    found = [("a-1", [1, 2, 3], layers), ("a-2", [1, 2, 3, 4], layers), ("b-1", [1, 2], layers),
             ("a-3", [5, 6], layers), ("ab-1", [1, 2, 3, 4, 5], layers)]  # fmt: skip
    chosen = kvstore.select(found, ["a-", "b-"], [])
    assert [(sel, rid) for sel, rid, _, _ in chosen] == [
        ("a-", "a-2"),
        ("a-", "a-3"),
        ("b-", "b-1"),
    ]
    assert kvstore.KVLayout.of_model(tiny[0]).nbytes(6) == buf.nbytes
    with pytest.raises(ProtocolError, match="ttl_s"):
        parse_kv_pin({"rids": ["a"], "ttl_s": 0})


def test_sglang_engines_share_prefix_kv_through_hicache_l3_flags() -> None:
    """SGLang has no KV export: its fallback is HiCache with a shared Mooncake store."""
    args, env = hicache_shared_l3(master="n1:50051", metadata_server="http://n1:8080/metadata",
                                  device="mlx5_0")  # fmt: skip
    cmd = ServerConfig(model_path="/models/q", extra_args=args, env=env).command(30000)
    value = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("--")}
    assert "--enable-hierarchical-cache" in cmd and "--enable-memory-saver" in cmd
    assert value["--hicache-storage-backend"] == "mooncake"
    assert value["--hicache-write-policy"] == "write_through"
    assert value["--hicache-storage-prefetch-policy"] == "wait_complete"
    assert value["--hicache-mem-layout"] == "page_first"  # what the mooncake backend needs
    assert env["MOONCAKE_MASTER"] == "n1:50051" and env["MOONCAKE_PROTOCOL"] == "rdma"
