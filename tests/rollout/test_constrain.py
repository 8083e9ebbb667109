"""The grammar constraint (llguidance) against slow, obvious references.

* regex: along random walks, the allowed tokens equal brute force with the `regex`
  module's partial matching ("the output plus this token is still a live prefix"), over
  every token whose bytes are whole UTF-8 text; hypothesis generates the patterns.
* json_schema: random walks that end always end in a JSON document the `jsonschema`
  package validates against the schema (hypothesis generates nested schemas with Unicode
  strings, enums, arrays and objects at any depth).
* terminators (EOS, stop ids) are allowed exactly when the output is complete, and a
  call's `ignore_eos` keeps EOS out.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import regex
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.errors import ProtocolError
from gyre.rollout.constrain import Constraint, GrammarCompiler
from gyre.rollout.protocol import SamplingParams

PATTERNS = [
    r'<tool_call>\n\{"name": "(get_weather|search)", "arguments": \{"q": "[a-z ]{0,8}"\}\}\n</tool_call>',
    r"def [a-z_]{1,8}\(\):",
    r"(yes|no)",
    r"[0-9]{1,3}(\.[0-9])?",
    r"[é☃a-c]{1,4}!",  # characters a byte-level vocabulary spells with several tokens
]


@pytest.fixture(scope="module")
def compiler(tiny: Any) -> GrammarCompiler:
    _, tok = tiny
    return GrammarCompiler(tok, len(tok))


@pytest.fixture(scope="module")
def texts(compiler: GrammarCompiler, tiny: Any) -> dict[int, str]:
    """Text of every non-special token whose bytes are non-empty, whole UTF-8."""
    _, tok = tiny
    lltok = compiler.tokenizer()
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    out = {}
    for i in range(len(tok)):
        if i in special:
            continue
        try:
            text = lltok.decode_bytes([i]).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            out[i] = text
    return out


def _terminators(tok: Any) -> torch.Tensor:
    mask = torch.zeros(len(tok), dtype=torch.bool)
    mask[tok.eos_token_id] = True
    return mask


def _walk(state: Constraint, eos: int, seed: int, steps: int, check: Any = None) -> list[int]:
    """Sample uniformly among allowed tokens until EOS (or `steps`); `check(mask, ids)`."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(steps):
        mask = state.allowed()
        if check is not None:
            check(mask, ids)
        choices = mask.nonzero().flatten().tolist()
        assert choices, "a live constraint always allows some token"
        token = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        if token == eos:
            return [*ids, eos]
        state.advance(token)
        ids.append(token)
    return ids


def _regex_oracle(pattern: str, texts: dict[int, str], tok: Any, lltok: Any) -> Any:
    """Allowed == live where the language leaves a choice of next character; where it
    forces the next character, the allowed tokens are live ones (llguidance then allows
    the canonical tokenization of the forced bytes only)."""

    def check(mask: torch.Tensor, ids: list[int]) -> None:
        try:
            text = lltok.decode_bytes(ids).decode("utf-8")
        except UnicodeDecodeError:
            return  # inside a character spelled by several tokens
        live = {
            t for t, piece in texts.items() if regex.fullmatch(pattern, text + piece, partial=True)
        }
        got = {t for t in mask.nonzero().flatten().tolist() if t in texts}
        done = bool(regex.fullmatch(pattern, text))
        if len({texts[t][0] for t in live}) > 1 or done:
            assert got == live, (text, sorted(got ^ live)[:10])
        else:
            assert bool(mask.any()) and got <= live, (text, sorted(got - live)[:10])
        assert bool(mask[tok.eos_token_id]) == done

    return check


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_allowed_tokens_equal_brute_force(
    pattern: str, compiler: GrammarCompiler, texts: dict[int, str], tiny: Any
) -> None:
    _, tok = tiny
    for seed in range(2):
        state = compiler.constraint(SamplingParams(regex=pattern), _terminators(tok))
        assert state is not None
        check = _regex_oracle(pattern, texts, tok, compiler.tokenizer())
        ids = _walk(state, tok.eos_token_id, seed, 80, check)
        assert ids[-1] == tok.eos_token_id
        assert regex.fullmatch(pattern, compiler.tokenizer().decode_bytes(ids[:-1]).decode())


ATOMS = st.sampled_from(["a", "b", "-", r"\{", "\\n", '"', "1", ".", "[ab]", "[a-b1]", r"\d", "é"])


def _quantify(node: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    suffix = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,3}"])
    return st.tuples(node, suffix).map(lambda t: t[0] if not t[1] else f"(?:{t[0]}){t[1]}")


PATTERN = st.recursive(
    _quantify(ATOMS),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
    ).flatmap(lambda p: _quantify(st.just(p))),
    max_leaves=6,
)


# derandomized: the brute-force oracle matches every vocabulary piece with `regex` (partial
# matching), and a random nested-quantifier pattern once made that backtrack for many minutes
# in CI; the same 20 generated patterns every run keep the oracle's cost known
@settings(
    max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(pattern=PATTERN, seed=st.integers(0, 1000))
def test_generated_regexes_agree_with_brute_force(
    pattern: str, seed: int, compiler: GrammarCompiler, texts: dict[int, str], tiny: Any
) -> None:
    _, tok = tiny
    state = compiler.constraint(SamplingParams(regex=pattern), _terminators(tok))
    assert state is not None
    _walk(
        state, tok.eos_token_id, seed, 12, _regex_oracle(pattern, texts, tok, compiler.tokenizer())
    )


SCALARS = st.one_of(
    st.just({"type": "string", "maxLength": 6}),
    st.just({"type": "string", "pattern": "^[a-zé]{1,3}$"}),
    st.just({"type": "integer", "minimum": -50, "maximum": 500}),
    st.just({"type": "number", "minimum": 0, "maximum": 10}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text("xyé☃ ", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
        lambda xs: {"enum": xs}
    ),
)


def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props)[: len(props) // 2 + 1],
        "additionalProperties": False,
    }


SCHEMA = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.dictionaries(
            st.text("abcd_", min_size=1, max_size=4), inner, min_size=1, max_size=3
        ).map(_object),
        inner.map(lambda s: {"type": "array", "items": s, "maxItems": 2}),
    ),
    max_leaves=5,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMA, seed=st.integers(0, 1000))
def test_json_schema_walks_end_in_valid_documents(
    schema: dict[str, Any], seed: int, compiler: GrammarCompiler, tiny: Any
) -> None:
    _, tok = tiny
    text_schema = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    state = compiler.constraint(SamplingParams(json_schema=text_schema), _terminators(tok))
    assert state is not None
    ids = _walk(state, tok.eos_token_id, seed, 400)
    assert ids[-1] == tok.eos_token_id, "a bounded schema's walk ends"
    doc = json.loads(compiler.tokenizer().decode_bytes(ids[:-1]).decode())
    jsonschema.validate(doc, schema)


def test_stop_ids_and_ignore_eos(compiler: GrammarCompiler, tiny: Any) -> None:
    _, tok = tiny
    stop = tok.convert_tokens_to_ids("<|endoftext|>")
    terminators = torch.zeros(len(tok), dtype=torch.bool)
    terminators[stop] = True  # ignore_eos: EOS is not a terminator, the stop id is
    state = compiler.constraint(SamplingParams(regex="(yes|no)"), terminators)
    assert state is not None
    assert not state.allowed()[stop] and not state.allowed()[tok.eos_token_id]
    for t in tok.encode("yes", add_special_tokens=False):
        state.advance(t)
    mask = state.allowed()
    assert mask[stop] and not mask[tok.eos_token_id] and int(mask.sum()) == 1


def test_added_tokens_are_named_by_id_in_grammars(compiler: GrammarCompiler, tiny: Any) -> None:
    _, tok = tiny
    call = tok.convert_tokens_to_ids("<tool_call>")
    state = compiler.constraint(SamplingParams(ebnf=f'start: <[{call}]> "x"'), _terminators(tok))
    assert state is not None
    assert state.allowed().nonzero().flatten().tolist() == [call]


@pytest.mark.parametrize(
    ("kind", "text", "needle"),
    [
        ("regex", "(?<=a)b", "look-around"),
        ("regex", "a(b", "unclosed group"),
        ("ebnf", "start: missing_rule", "missing_rule"),
        ("json_schema", "{not json", "json_schema"),
    ],
)
def test_unsupported_grammars_are_protocol_errors(
    kind: str, text: str, needle: str, compiler: GrammarCompiler, tiny: Any
) -> None:
    _, tok = tiny
    with pytest.raises(ProtocolError, match=needle):
        compiler.constraint(SamplingParams(**{kind: text}), _terminators(tok))
