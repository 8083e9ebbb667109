"""The regex constraint's allowed-token sets against brute force with the `regex` module's
partial matching (the slow, obvious definition of "keeps the output a live prefix")."""

from __future__ import annotations

from typing import Any

import pytest
import regex
import torch

from gyre.rollout.constrain import RegexCompiler, RegexState, token_texts

PATTERNS = [
    r'<tool_call>\n\{"name": "(get_weather|search)", "arguments": \{"q": "[a-z ]{0,8}"\}\}\n</tool_call>',
    r"def [a-z_]{1,8}\(\):",
    r"(yes|no)",
    r"[0-9]{1,3}(\.[0-9])?",
]


def _brute_force(pattern: str, text: str, texts: dict[int, str]) -> set[int]:
    return {
        tok for tok, piece in texts.items() if regex.fullmatch(pattern, text + piece, partial=True)
    }


@pytest.mark.parametrize("pattern", PATTERNS)
def test_allowed_tokens_equal_brute_force_along_a_random_walk(pattern: str, tiny: Any) -> None:
    _, tok = tiny
    texts = token_texts(tok)
    eos = tok.eos_token_id
    terminators = torch.zeros(len(tok), dtype=torch.bool)
    terminators[eos] = True
    state = RegexState(RegexCompiler(tok, len(tok)).compile(pattern), terminators)
    gen = torch.Generator().manual_seed(len(pattern))
    text = ""
    for _ in range(60):
        allowed = state.allowed()
        ids = set(allowed.nonzero().flatten().tolist())
        assert ids - {eos} == _brute_force(pattern, text, texts)
        assert (eos in ids) == bool(regex.fullmatch(pattern, text))
        choices = sorted(ids)
        token = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        if token == eos:
            break
        state.advance(token)
        text += texts[token]
    assert regex.fullmatch(pattern, text)


def test_byte_level_token_texts_round_trip(tiny: Any) -> None:
    _, tok = tiny
    texts = token_texts(tok)
    assert texts[tok.convert_tokens_to_ids("<tool_call>")] == "<tool_call>"
    assert tok.eos_token_id not in texts
    for token in list(texts)[:: max(1, len(texts) // 300)]:
        assert tok.decode([token]) == texts[token]
