"""Paced devices: a paced engine delivers each call at its modelled end (processor sharing
under `EngineModel`), aborts reach calls still held, and work slower than its model is
counted as an overrun (docs/pacing.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gyre.rollout.client import EngineClient
from gyre.rollout.pacing import Pacer
from gyre.rollout.protocol import SamplingParams
from gyre.rollout.testing import running_engine
from gyre.schedule.devices import CallCost, EngineModel

from .conftest import run

SCALE = 10.0
MODEL = EngineModel(reference_load=1, half=1.0, generation_share=1.0)
CALLS = CallCost(prefill_tokens_per_s=1e9, decode_s_per_token=0.5)  # 20 tokens: 10 s
TOKENS = 20


def _pace(scale: float) -> str:
    return json.dumps({"scale": scale, "model": {"reference_load": 1, "half": 1.0,
                       "generation_share": 1.0}, "calls": {"prefill_tokens_per_s": 1e9,
                       "decode_s_per_token": 0.5}})  # fmt: skip


@pytest.fixture(scope="module")
def paced_url() -> Iterator[str]:
    with running_engine("tiny", max_batch_size=8, extra_args=("--pace", _pace(SCALE))) as url:
        yield url


SAMPLING = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.0)


async def _timed(client: EngineClient, prompt: list[int], rid: str) -> tuple[float, Any]:
    t0 = time.monotonic()
    result = await client.generate(prompt, SAMPLING, rid)
    return time.monotonic() - t0, result


def test_a_call_takes_its_modelled_time(paced_url: str, prompt: list[int]) -> None:
    wall, result = run(_timed(EngineClient(paced_url), prompt, "alone"))
    modelled = CALLS.nominal_s(len(prompt), 0, TOKENS) / MODEL.rate(1) / SCALE  # 1.0 s
    assert len(result.output_ids) == TOKENS  # the tiny model's real tokens
    assert wall >= modelled


def test_concurrent_calls_share_the_engine(paced_url: str, prompt: list[int]) -> None:
    """Two calls at once each progress at rate(2) < rate(1): the load curve of `gyre sim`."""

    async def both() -> list[tuple[float, Any]]:
        client = EngineClient(paced_url)
        return list(await asyncio.gather(_timed(client, prompt, "a"), _timed(client, prompt, "b")))

    modelled = CALLS.nominal_s(len(prompt), 0, TOKENS) / MODEL.rate(2) / SCALE  # 1.5 s
    assert MODEL.rate(2) < MODEL.rate(1)
    for wall, _ in run(both()):
        assert wall >= modelled * 0.98  # both arrive within the pacer's clock granularity


def test_abort_ends_a_call_whose_modelled_generation_still_runs(
    paced_url: str, prompt: list[int]
) -> None:
    async def scenario() -> tuple[float, Any]:
        client = EngineClient(paced_url)
        task = asyncio.ensure_future(_timed(client, prompt, "held"))
        await asyncio.sleep(0.4)  # the tiny model is done; the modelled call runs to 1.0 s
        assert (await client.stats())["pace"]["load"] == 1
        await client.abort_all()
        return await task

    wall, result = run(scenario())
    assert result.finish_type == "abort"
    assert wall < 0.9


def test_work_slower_than_its_model_is_an_overrun(prompt: list[int]) -> None:
    """At a scale where no real call can keep up, every call is counted late, not hidden."""
    with running_engine("tiny", extra_args=("--pace", _pace(1e7))) as url:

        async def scenario() -> dict[str, Any]:
            client = EngineClient(url)
            for i in range(3):
                await client.generate(prompt, SAMPLING, f"late-{i}")
            return dict((await client.stats())["pace"])

        pace = run(scenario())
    assert pace["work"] == 3 and pace["overruns"] == 3 and pace["overrun_s"] > 0
    assert pace["load"] == 0


def test_pacer_holds_work_and_counts_late_work(tmp_path: Any) -> None:
    pacer = Pacer(10.0, report=tmp_path / "pace.json")
    t0 = time.monotonic()
    pacer.hold(2.0, since=t0)  # 2 modelled seconds: 0.2 s of wall time
    assert time.monotonic() - t0 >= 0.2
    assert pacer.stats.overruns == 0
    pacer.hold(1.0, since=time.monotonic() - 1.0)  # the work took 1 s, its model 0.1 s
    assert pacer.stats.overruns == 1 and pacer.stats.overrun_s == pytest.approx(0.9, abs=0.05)
    assert json.loads((tmp_path / "pace.json").read_text())["work"] == 2
