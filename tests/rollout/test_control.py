"""Control routes of the embedded engine: abort, pause/continue, the request log, and
clear 400s for bad requests."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from gyre.errors import EngineError
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams

from .conftest import run

T = TypeVar("T")
LONG = SamplingParams(max_new_tokens=5000, temperature=1.0, ignore_eos=True)


async def _wait_running(client: EngineClient, n: int) -> None:
    for _ in range(200):
        if (await client.stats())["running"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("requests never started")


def test_abort_by_rid_returns_partial_output(engine_url: str, prompt: list[int]) -> None:
    async def scenario() -> Any:
        client = EngineClient(engine_url)
        task = asyncio.ensure_future(client.generate(prompt, LONG, "victim"))
        other = asyncio.ensure_future(
            client.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), "bystander")
        )
        await _wait_running(client, 2)
        await asyncio.sleep(0.2)
        await client.abort("victim")
        return await task, await other

    victim, bystander = run(scenario())
    assert victim.finish_type == "abort" and victim.message
    assert 0 < len(victim.output_ids) < 5000
    assert len(victim.output_logprobs) == len(victim.output_ids)
    assert (bystander.finish_type, len(bystander.output_ids)) == ("length", 30)


def test_abort_all_ends_every_call(engine_url: str, prompt: list[int]) -> None:
    async def scenario() -> list[Any]:
        client = EngineClient(engine_url)
        tasks = [asyncio.ensure_future(client.generate(prompt, LONG, f"all-{i}")) for i in range(3)]
        await _wait_running(client, 3)
        await client.abort_all()
        return list(await asyncio.gather(*tasks))

    assert [r.finish_type for r in run(scenario())] == ["abort"] * 3


async def _paused_during_a_call(
    engine_url: str,
    prompt: list[int],
    mode: str,
    observe: Callable[[EngineClient, asyncio.Future[Any]], Awaitable[T]],
) -> tuple[Any, Any, T]:
    """A greedy call run alone, then the same call paused in `mode` while it decodes: both
    results, and what `observe(client, the paused call)` saw while the engine was paused."""
    sp = SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True)
    client = EngineClient(engine_url)
    solo = await client.generate(prompt, sp, f"solo-{mode}")
    task = asyncio.ensure_future(client.generate(prompt, sp, f"paused-{mode}"))
    await _wait_running(client, 1)
    await client.pause(mode)
    try:
        seen = await observe(client, task)
    finally:
        await client.resume()  # never leave the shared engine paused
    return solo, await task, seen


def test_pause_holds_inflight_calls_until_continue(engine_url: str, prompt: list[int]) -> None:
    async def held(client: EngineClient, call: asyncio.Future[Any]) -> bool:
        await asyncio.sleep(0.5)
        return not call.done() and (await client.stats())["running"] == 1

    solo, paused, was_held = run(_paused_during_a_call(engine_url, prompt, "in_place", held))
    assert was_held
    assert paused.output_ids == solo.output_ids  # in-place pause changes nothing


def test_retract_pause_requeues_and_completes(engine_url: str, prompt: list[int]) -> None:
    solo, retracted, stats = run(
        _paused_during_a_call(engine_url, prompt, "retract", lambda client, _: client.stats())
    )
    assert (stats["running"], stats["pending"]) == (0, 1)
    assert retracted.output_ids == solo.output_ids
    assert retracted.output_logprobs == pytest.approx(solo.output_logprobs, abs=1e-4)


def test_request_log_records_what_the_engine_received(engine_url: str, prompt: list[int]) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        client = EngineClient(engine_url)
        await client.generate(prompt[:5], SamplingParams(max_new_tokens=2), "logged-1")
        await client.generate(prompt, SamplingParams(max_new_tokens=2), "logged-2")
        seen = [r for r in await client.request_log() if r["rid"].startswith("logged-")]
        await client.clear_request_log()
        return seen, await client.request_log()

    log, cleared = run(scenario())
    assert [(r["rid"], r["input_ids"]) for r in log] == [
        ("logged-1", prompt[:5]),
        ("logged-2", prompt),
    ]
    assert cleared == []


def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": "hello"}, "list of token ids"),
        ({"input_ids": [1, "2"]}, "input_ids[1]"),
        ({"input_ids": [1, 2.5]}, "input_ids[1]"),
        ({"input_ids": [1, 4096]}, "out of range"),
        ({"input_ids": [-1]}, "out of range"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 1}}, "frequency_penalty"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [99999]}}, "stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"regex": "(?<=a)b"}}, "regex"),
        ({"input_ids": [1], "sampling_params": {"regex": "a(b"}}, "regex"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ({"input_ids": [1], "text": "hi"}, "text"),
        (b"{not json", "JSON"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_field(
    engine_url: str, body: Any, needle: str
) -> None:
    status, reply = _post(engine_url + "/generate", body)
    assert status == 400
    assert needle in reply["message"], reply
    assert reply["object"] == "error" and reply["code"] == 400


def test_client_reports_http_errors_and_dead_engines(engine_url: str) -> None:
    with pytest.raises(EngineError, match="out of range"):
        run(EngineClient(engine_url).generate([10**6], SamplingParams(), "bad"))
    dead = EngineClient("http://127.0.0.1:9", engine_id="dead", connect_timeout=2)
    assert run(dead.health()) is False
    with pytest.raises(EngineError, match="dead"):
        run(dead.weight_version())
    assert run(EngineClient(engine_url).health()) is True
    info = run(EngineClient(engine_url).model_info())
    assert info["vocab_size"] == 4096 and info["model_path"] == "tiny"


def test_client_disconnect_aborts_the_call(engine_url: str, prompt: list[int]) -> None:
    async def scenario() -> dict[str, Any]:
        impatient = EngineClient(engine_url, timeout=0.5)
        with pytest.raises(EngineError, match="599"):
            await impatient.generate(prompt, LONG, "impatient")
        client = EngineClient(engine_url)
        for _ in range(100):
            stats = await client.stats()
            if stats["running"] == stats["pending"] == 0:
                break
            await asyncio.sleep(0.05)
        return stats

    stats = run(scenario())
    assert stats["running"] == stats["pending"] == 0
    assert run(EngineClient(engine_url).health())
