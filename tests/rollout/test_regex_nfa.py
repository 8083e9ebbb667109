"""The lazy-DFA regex engine against the `regex` module (the slow, obvious reference):
full matches and live prefixes (partial matches) agree on generated patterns and strings."""

from __future__ import annotations

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.rollout.regex_nfa import LazyDFA, RegexSyntaxError, fullmatch

ALPHABET = 'ab-{}\n"1 '
atoms = st.sampled_from(
    [
        "a",
        "b",
        "-",
        r"\{",
        r"\}",
        "\\n",
        '"',
        "1",
        ".",
        "[ab]",
        "[^a]",
        "[a-b1]",
        r"\d",
        r"\s",
        r"\w",
    ]
)


def _quantify(node: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    # No lazy quantifiers here: the regex module's partial matching mishandles them
    # (e.g. "(a*|a*?a)" partially matches "1"); see test_lazy_quantifiers_match_greedy_ones.
    suffix = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,3}", "{1,}"])
    return st.tuples(node, suffix).map(lambda t: t[0] if not t[1] else f"(?:{t[0]}){t[1]}")


patterns = st.recursive(
    _quantify(atoms),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=4).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        _quantify(inner),
    ),
    max_leaves=8,
)


def _walk(dfa: LazyDFA, text: str) -> list[int]:
    states = [dfa.initial]
    for ch in text:
        states.append(dfa.step(states[-1], ch) if states[-1] >= 0 else -1)
    return states


@settings(max_examples=300, deadline=None)
@given(pattern=patterns, text=st.text(alphabet=ALPHABET, max_size=8))
def test_matches_and_live_prefixes_agree_with_the_regex_module(pattern: str, text: str) -> None:
    dfa = LazyDFA(pattern)
    states = _walk(dfa, text)
    for k, state in enumerate(states):
        prefix = text[:k]
        live = regex.fullmatch(pattern, prefix, partial=True) is not None
        assert (state >= 0) == live, (pattern, prefix)
        if state >= 0:
            assert dfa.accepting(state) == (regex.fullmatch(pattern, prefix) is not None)


@pytest.mark.parametrize(
    "pattern",
    [r"(?=a)b", r"(?<!a)b", r"(a)\1", r"(?i)a", "a(b", "a)b", r"a{3,1}", "*a", r"a$b", r"\p{L}"],
)
def test_unsupported_syntax_is_rejected_with_its_position(pattern: str) -> None:
    with pytest.raises(RegexSyntaxError, match="position"):
        LazyDFA(pattern)


def test_anchors_at_the_ends_and_escapes() -> None:
    dfa = LazyDFA(r"^\x41\u00e9[\]\-]\$$")
    states = _walk(dfa, "Aé]$")
    assert states[-1] >= 0 and dfa.accepting(states[-1])
    assert _walk(dfa, "Aéx")[-1] == -1
    assert fullmatch(r"[a-z]{2}\d", "ab1") and not fullmatch(r"[a-z]{2}\d", "ab")


def test_lazy_quantifiers_match_greedy_ones() -> None:
    for lazy, greedy in [("(a*|a*?a)b", "(a*|a*a)b"), ("x+?y??", "x+y?")]:
        for text in ["", "b", "ab", "aab", "1", "x", "xy", "xxy", "y", "xyy"]:
            a, b = _walk(LazyDFA(lazy), text)[-1], _walk(LazyDFA(greedy), text)[-1]
            assert (a >= 0) == (b >= 0) == (regex.fullmatch(greedy, text, partial=True) is not None)
