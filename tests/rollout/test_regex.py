"""Constrained decoding through the engine: forced tool calls by regex, grammar and schema.

The constraint restricts what is sampled; the behaviour log-prob the engine reports stays
the model's own (raw logits, T = 1, no mask), which these tests recompute with the model.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import regex
import torch

from gyre.errors import EngineError
from gyre.rollout.client import EngineClient
from gyre.rollout.constrain import GrammarCompiler
from gyre.rollout.protocol import SamplingParams

from .conftest import run

TOOL_CALL = (
    r'<tool_call>\n\{"name": "(get_weather|search_files)", '
    r'"arguments": \{"city": "[A-Za-z ]{1,12}", "days": [1-9]\}\}\n</tool_call>'
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def test_regex_forces_a_parseable_tool_call(engine_url: str, prompt: list[int], tiny: Any) -> None:
    _, tok = tiny
    sp = SamplingParams(max_new_tokens=120, temperature=1.0, regex=TOOL_CALL, sampling_seed=3)
    res = run(EngineClient(engine_url).generate(prompt, sp, "tool"))
    assert (res.finish_type, res.matched) == ("stop", tok.eos_token_id)
    text = tok.decode(res.output_ids[:-1])
    assert regex.fullmatch(TOOL_CALL, text), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] in ("get_weather", "search_files") and 1 <= call["arguments"]["days"] <= 9


def test_constrained_log_probs_are_the_models_own(
    engine_url: str, prompt: list[int], tiny: Any
) -> None:
    """Every sampled token was allowed by the mask, and its reported log-prob is the
    unmasked log-softmax of the model's logits (what the trainer recomputes)."""
    model, tok = tiny
    pattern = "def [a-z]{1,6}\\(\\):"
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, regex=pattern, sampling_seed=11)
    res = run(EngineClient(engine_url).generate(prompt, sp, "masked"))
    assert regex.fullmatch(pattern, tok.decode(res.output_ids[:-1]))
    terminators = torch.zeros(len(tok), dtype=torch.bool)
    terminators[tok.eos_token_id] = True
    state = GrammarCompiler(tok, len(tok)).constraint(sp, terminators)
    assert state is not None
    ids = torch.tensor([prompt + res.output_ids[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].double()
    masked_differs = False
    for k, token in enumerate(res.output_ids):
        allowed = state.allowed()
        assert allowed[token]
        raw = float(torch.log_softmax(logits[k], dim=-1)[token])
        masked = float(torch.log_softmax(logits[k].masked_fill(~allowed, float("-inf")), -1)[token])
        assert abs(raw - res.output_logprobs[k]) < 1e-4
        masked_differs |= abs(masked - raw) > 1e-3
        state.advance(token)
    assert masked_differs  # the test can tell the two semantics apart


@pytest.mark.parametrize("field", ["ebnf", "json_schema"])
def test_grammar_and_schema_constraints_end_in_valid_json(
    field: str, engine_url: str, prompt: list[int], tiny: Any
) -> None:
    _, tok = tiny
    if field == "ebnf":
        kw = {"ebnf": 'start: "ANSWER: " obj\nobj: %json ' + json.dumps(SCHEMA)}
    else:
        kw = {"json_schema": json.dumps(SCHEMA)}
    sp = SamplingParams(max_new_tokens=80, temperature=1.0, sampling_seed=5, **kw)
    res = run(EngineClient(engine_url).generate(prompt, sp, f"grammar-{field}"))
    assert (res.finish_type, res.matched) == ("stop", tok.eos_token_id)
    doc = json.loads(tok.decode(res.output_ids[:-1]).removeprefix("ANSWER: "))
    assert doc["days"] in (1, 2, 3) and len(doc["city"]) <= 8


def test_unsupported_regex_is_a_400(engine_url: str, prompt: list[int]) -> None:
    sp = SamplingParams(max_new_tokens=4, regex="(?<=a)b")
    with pytest.raises(EngineError, match=r"(?s)HTTP 400.*look-around"):
        run(EngineClient(engine_url).generate(prompt, sp, "bad-regex"))
