"""The embedded engine's /generate against a slow reference: greedy determinism, exact
behaviour log-probs (greedy and sampled), batching, stop tokens and length limits.

A behaviour log-prob is the model's own log-probability of the sampled token (raw logits,
T = 1, no truncation: docs/objective.md), whatever distribution the token was sampled from;
the sample itself lies in the processed (temperature, top-p) distribution's support."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import GenerateResult, SamplingParams

from .conftest import run
from .reference import reference_logits, slow_distribution

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


async def generate(url: str, ids: list[int], sp: SamplingParams, rid: str) -> GenerateResult:
    return await EngineClient(url).generate(ids, sp, rid)


def test_greedy_is_deterministic_and_reports_length(engine_url: str, prompt: list[int]) -> None:
    a = run(generate(engine_url, prompt, GREEDY, "greedy-a"))
    b = run(generate(engine_url, prompt, GREEDY, "greedy-b"))
    assert a.output_ids == b.output_ids
    assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)  # b: prefix cache
    assert (a.finish_type, a.completion_tokens, len(a.output_ids)) == ("length", 16, 16)
    assert a.prompt_tokens == len(prompt)
    assert a.weight_version == "0"
    assert a.rid == "greedy-a"


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_numpy_input_ids_are_sent_as_the_same_ids(
    engine_url: str, prompt: list[int], dtype: Any
) -> None:
    """The proxy passes its int32 context arrays straight to the client (no list copy)."""
    a = run(generate(engine_url, prompt, GREEDY, "list-ids"))
    b = run(
        EngineClient(engine_url).generate(
            np.repeat(np.asarray(prompt, dtype), 2)[::2], GREEDY, "np"
        )
    )
    assert (b.output_ids, b.prompt_tokens) == (a.output_ids, len(prompt))


def test_greedy_logprobs_match_plain_forward(engine_url: str, prompt: list[int], tiny: Any) -> None:
    """Also shows the tiny model has the same weights in the engine process and here."""
    model, _ = tiny
    res = run(generate(engine_url, prompt, GREEDY, "greedy-ref"))
    for k, row in enumerate(reference_logits(model, prompt, res.output_ids)):
        dist = slow_distribution(row, 0.0, 1.0)
        assert res.output_ids[k] == max(range(len(row)), key=lambda i: (row[i], -i))
        assert res.output_logprobs[k] == pytest.approx(dist[res.output_ids[k]], abs=1e-4)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_sampled_logprobs_match_processed_distribution(
    engine_url: str, prompt: list[int], tiny: Any, temperature: float, top_p: float
) -> None:
    model, _ = tiny
    sp = SamplingParams(
        max_new_tokens=12, temperature=temperature, top_p=top_p, ignore_eos=True, sampling_seed=7
    )
    res = run(generate(engine_url, prompt, sp, f"sample-{temperature}-{top_p}"))
    again = run(generate(engine_url, prompt, sp, "sample-again"))
    assert res.output_ids == again.output_ids  # the seed fixes the sample
    for k, row in enumerate(reference_logits(model, prompt, res.output_ids)):
        dist = slow_distribution(row, temperature, top_p)
        assert res.output_ids[k] in dist, "sampled a token outside the top-p nucleus"
        policy = slow_distribution(row, 1.0, 1.0)  # what the trainer recomputes
        assert res.output_logprobs[k] == pytest.approx(policy[res.output_ids[k]], abs=1e-4)


def test_concurrent_calls_are_batched_and_match_solo_results(
    engine_url: str, prompt: list[int]
) -> None:
    prompts = [prompt, prompt[:7], prompt[3:] + prompt[:2], prompt[:1]]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    solo = [run(generate(engine_url, p, sp, f"solo-{i}")) for i, p in enumerate(prompts)]

    async def together() -> tuple[list[GenerateResult], dict[str, Any]]:
        client = EngineClient(engine_url)
        before = await client.stats()
        results = await asyncio.gather(
            *(client.generate(p, sp, f"batch-{i}") for i, p in enumerate(prompts))
        )
        after = await client.stats()
        steps = {
            int(k): v - before["decode_steps_by_batch_size"].get(k, 0)
            for k, v in after["decode_steps_by_batch_size"].items()
        }
        return list(results), steps

    batched, steps = run(together())
    assert max(k for k, v in steps.items() if v > 0) > 1, steps
    for s, b in zip(solo, batched, strict=True):
        assert b.output_ids == s.output_ids
        assert b.output_logprobs == pytest.approx(s.output_logprobs, abs=1e-4)


def test_stop_token_ends_the_call_and_is_included(engine_url: str, prompt: list[int]) -> None:
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=4)
    free = run(generate(engine_url, prompt, sp, "free"))
    stop = free.output_ids[5]
    first = free.output_ids.index(stop)
    sp.stop_token_ids = [stop]
    res = run(generate(engine_url, prompt, sp, "stopped"))
    assert res.output_ids == free.output_ids[: first + 1]
    assert (res.finish_type, res.matched) == ("stop", stop)
    assert len(res.output_logprobs) == len(res.output_ids)


def test_zero_max_new_tokens_returns_at_once(engine_url: str, prompt: list[int]) -> None:
    res = run(generate(engine_url, prompt, SamplingParams(max_new_tokens=0), "zero"))
    assert (res.output_ids, res.finish_type, res.completion_tokens) == ([], "length", 0)


def test_prefix_cache_reuses_a_previous_call_without_changing_logprobs(
    engine_url: str, prompt: list[int], tiny: Any
) -> None:
    model, _ = tiny
    first = run(generate(engine_url, prompt, GREEDY, "turn-1"))
    context = prompt + first.output_ids + prompt[:9]  # the next turn extends the first
    sp = SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True, sampling_seed=1)
    second = run(generate(engine_url, context, sp, "turn-2"))
    # The cache holds the first call's context minus its last (never fed) token.
    assert len(prompt) + len(first.output_ids) - 1 <= second.cached_tokens < len(context)
    for k, row in enumerate(reference_logits(model, context, second.output_ids)):
        dist = slow_distribution(row, 1.0, 1.0)  # the policy's own log-prob (sampled at T=0.8)
        assert second.output_logprobs[k] == pytest.approx(dist[second.output_ids[k]], abs=1e-4)

    async def flushed() -> GenerateResult:
        client = EngineClient(engine_url)
        await client.flush_cache()
        return await client.generate(context, sp, "turn-2-again")

    again = run(flushed())
    assert again.cached_tokens == 0
    assert again.output_ids == second.output_ids
    assert again.output_logprobs == pytest.approx(second.output_logprobs, abs=1e-4)
