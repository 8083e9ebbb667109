"""Regex-constrained decoding through the engine: forced tool calls."""

from __future__ import annotations

import json
from typing import Any

import regex

from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams

from .conftest import run

TOOL_CALL = (
    r'<tool_call>\n\{"name": "(get_weather|search_files)", '
    r'"arguments": \{"city": "[A-Za-z ]{1,12}", "days": [1-9]\}\}\n</tool_call>'
)


def test_regex_forces_a_parseable_tool_call(engine_url: str, prompt: list[int], tiny: Any) -> None:
    _, tok = tiny
    sp = SamplingParams(max_new_tokens=120, temperature=1.0, regex=TOOL_CALL, sampling_seed=3)
    res = run(EngineClient(engine_url).generate(prompt, sp, "tool"))
    assert (res.finish_type, res.matched) == ("stop", tok.eos_token_id)
    text = tok.decode(res.output_ids[:-1])
    assert regex.fullmatch(TOOL_CALL, text), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] in ("get_weather", "search_files") and 1 <= call["arguments"]["days"] <= 9
    assert all(lp <= 1e-9 for lp in res.output_logprobs)
    assert res.output_logprobs[-1] == 0.0  # only EOS could follow the full match


def test_regex_log_probs_are_of_the_masked_distribution(
    engine_url: str, prompt: list[int], tiny: Any
) -> None:
    """A literal pattern leaves one continuation per step: every log-prob must then be
    the renormalized mass over the tokens the pattern allows."""
    import torch

    from gyre.rollout.constrain import RegexCompiler, RegexState

    model, tok = tiny
    pattern = "def [a-z]{1,6}\\(\\):"
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, regex=pattern, sampling_seed=11)
    res = run(EngineClient(engine_url).generate(prompt, sp, "masked"))
    assert regex.fullmatch(pattern, tok.decode(res.output_ids[:-1]))
    terminators = torch.zeros(len(tok), dtype=torch.bool)
    terminators[tok.eos_token_id] = True
    state = RegexState(RegexCompiler(tok, len(tok)).compile(pattern), terminators)
    ids = torch.tensor([prompt + res.output_ids[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].double()
    for k, token in enumerate(res.output_ids):
        allowed = state.allowed()
        lp = torch.log_softmax(logits[k].masked_fill(~allowed, float("-inf")), dim=-1)
        assert abs(float(lp[token]) - res.output_logprobs[k]) < 1e-4
        state.advance(token)
