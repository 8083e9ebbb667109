"""Input-token log-probs (`logprob_start_len`), SGLang's scoring prefill, on the embedded engine.

The proxy rescores constrained calls on engines that report grammar-masked log-probs with
one prefill (`EngineClient.score`: `max_new_tokens` 0, `return_logprob`, `logprob_start_len`);
the embedded engine answers it in SGLang's shape, so the CPU tests drive that client code:

* the scored log-probs of a call's output are the output log-probs the call reported (the
  same model's own log-probs, float64 `policy_logprobs`, from a prefill instead of decoding);
* `meta_info.input_token_logprobs` is SGLang's: `[log-prob, token id, None]` for every input
  token from `logprob_start_len` on, the first log-prob None; nothing is generated;
* by default (-1) no input token is listed, and a `logprob_start_len` past the input is
  refused (400), as SGLang 0.5.21 does.
"""

from __future__ import annotations

from typing import Any

import pytest

from gyre.errors import ProtocolError
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams, score_body

from .conftest import post_json, run
from .reference import reference_logits, slow_distribution

SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, sampling_seed=7)


def test_scored_output_logprobs_equal_the_ones_generation_reported(
    engine_url: str, prompt: list[int], tiny: Any
) -> None:
    client = EngineClient(engine_url)
    gen = run(client.generate(prompt, SAMPLED, "score-gen"))
    scored = run(client.score(prompt + gen.output_ids, len(prompt), "score-it"))
    assert len(scored.logprobs) == len(gen.output_ids) == 12
    assert scored.logprobs == pytest.approx(gen.output_logprobs, abs=1e-5)
    assert scored.weight_version == gen.weight_version == "0"
    assert scored.cached_tokens == len(prompt) - 1  # the context up to the start, as SGLang
    model, _ = tiny  # and both are the model's own log-probs (slow reference)
    for k, row in enumerate(reference_logits(model, prompt, gen.output_ids)):
        own = slow_distribution(row, 1.0, 1.0)[gen.output_ids[k]]
        assert scored.logprobs[k] == pytest.approx(own, abs=1e-4)


def test_input_token_logprobs_have_sglang_shape(engine_url: str, prompt: list[int]) -> None:
    ids = prompt[:10]
    status, body = post_json(engine_url + "/generate", score_body(ids, 4, "score-shape"))
    assert status == 200, body
    meta = body["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[3:]  # from logprob_start_len = start - 1
    assert entries[0][0] is None and all(isinstance(e[0], float) for e in entries[1:])
    assert all(len(e) == 3 and e[2] is None for e in entries)
    assert body["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (10, 0)


def test_a_plain_call_lists_no_input_tokens(engine_url: str, prompt: list[int]) -> None:
    """SGLang 0.5.21's default (`logprob_start_len` -1) and a start at the input's end."""
    for start in (-1, len(prompt)):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2},
                "return_logprob": True, "logprob_start_len": start}  # fmt: skip
        status, reply = post_json(engine_url + "/generate", body)
        assert status == 200, reply
        assert reply["meta_info"]["input_token_logprobs"] == []
        assert len(reply["meta_info"]["output_token_logprobs"]) == 2


@pytest.mark.parametrize("start", [11, 12, -2])
def test_a_start_outside_the_input_is_refused(
    engine_url: str, prompt: list[int], start: int
) -> None:
    body = {"input_ids": prompt[:10], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": start}  # fmt: skip
    status, reply = post_json(engine_url + "/generate", body)
    assert status == 400 and "logprob_start_len" in reply["message"], reply


def test_score_body_needs_a_token_before_the_scored_ones() -> None:
    with pytest.raises(ProtocolError, match="start"):
        score_body([1, 2, 3], 0, "r")
