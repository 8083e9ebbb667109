"""Pure request/response logic: both APIs' parsing, SSE shapes, tool-call parsing, keys.

No server here: these are the functions the handlers call, checked against obvious
references and with property-based tests.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.models import tiny_tokenizer
from gyre.proxy import anthropic_api, matching, openai_api
from gyre.proxy.conversation import Conversation, Message, Reply, ToolCall
from gyre.proxy.errors import ApiError, anthropic_error_body, openai_error_body
from gyre.proxy.toolcalls import HERMES, LLAMA3_JSON, forced_call_grammar, parse_output
from gyre.rollout.constrain import Grammar, GrammarCompiler

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "all": {"type": "boolean"},
                    "depth": {"type": "integer"},
                    "mode": {"enum": ["a", "b"]},
                    "ratio": {"type": "number"},
                },
                "required": ["path", "all", "depth", "mode", "ratio"],
            },
        },
    },
    {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}},
    {
        "type": "function",
        "function": {
            "name": "nested",
            "parameters": {
                "type": "object",
                "properties": {
                    "opts": {"type": "object", "properties": {"k": {"type": "string"}}},
                    "xs": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
]


def test_claude_code_shaped_request() -> None:
    body = {
        "model": "m",
        "max_tokens": 100,
        "stream": True,
        "metadata": {"user_id": '{"a": 1}'},
        "thinking": {"type": "disabled"},
        "context_management": {},
        "output_config": {},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; h=abc"},
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": [
            {"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "messages": [
            {"role": "system", "content": "reminder"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "do it", "cache_control": {"type": "ephemeral"}}
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"c": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": "out"},
                            {"type": "image", "source": {}},
                        ],
                    },
                    {"type": "text", "text": "next"},
                ],
            },
        ],
    }
    req = anthropic_api.parse_request(body)
    conv = req.conversation
    assert (
        conv.system == "x-anthropic-billing-header: cc_version=2.1; h=abc\n\nYou are Claude Code."
    )
    assert conv.tool_names() == ["Bash"]  # the server tool is dropped
    assert [(m.role, m.content) for m in conv.messages] == [
        ("system", "reminder"),
        ("user", "do it"),
        ("assistant", "ok"),
        ("tool", "out\n\n[image omitted]"),
        ("user", "next"),
    ]
    assert conv.messages[2].tool_calls == [
        ToolCall(id="toolu_1", name="Bash", arguments='{"c": 1}')
    ]
    assert conv.messages[3].tool_call_id == "toolu_1"
    assert req.stream and req.max_tokens == 100 and req.tool_choice.mode == "auto"


def test_openai_request_normalization() -> None:
    body = {
        "model": "m",
        "max_completion_tokens": 5,
        "temperature": 0,
        "tools": TOOLS[:1],
        "tool_choice": {"type": "function", "function": {"name": "ls"}},
        "messages": [
            {"role": "developer", "content": "d"},
            {"role": "system", "content": "s"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
            {"role": "system", "content": "late"},
        ],
    }
    req = openai_api.parse_request(body)
    assert req.conversation.system == "d\n\ns"
    assert [m.role for m in req.conversation.messages] == ["user", "assistant", "tool", "system"]
    assert req.conversation.messages[0].content == "ab"
    assert (req.max_tokens, req.temperature, req.tool_choice.name) == (5, 0.0, "ls")


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"model": "m"}, "body.messages: required"),
        ({"model": "m", "messages": []}, "at least one"),
        (
            {"model": 3, "messages": [{"role": "user", "content": "x"}]},
            "body.model: expected a string",
        ),
        ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "allowed: system"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, ">= 1"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "integer",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9},
            "out of range",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": "required",
            },
            "needs at least one tool",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ],
            },
            "JSON object",
        ),
    ],
)
def test_openai_errors_name_the_field(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ApiError) as e:
        openai_api.parse_request(body)
    assert fragment in e.value.message and e.value.status == 400


def test_error_shapes() -> None:
    err = ApiError("overloaded", "busy")
    assert openai_error_body(err) == (
        503,
        {"error": {"message": "busy", "type": "server_error", "param": None, "code": "overloaded"}},
    )
    assert anthropic_error_body(err) == (
        529,
        {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
    )
    assert (
        anthropic_error_body(ApiError("too_large", "big"))[1]["error"]["type"]
        == "request_too_large"
    )


REPLY = Reply(
    id="r1",
    model="m",
    content="Let me look." * 10,
    tool_calls=[ToolCall(id="toolu_a", name="ls", arguments='{"path": "/x", "all": true}')],
    finish="tool_calls",
    prompt_tokens=7,
    completion_tokens=9,
    created=1,
)


def test_anthropic_sse_events_and_reassembly() -> None:
    raw = "".join(anthropic_api.stream_events(REPLY))
    events = [e for e in raw.split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(e.startswith("event: ") for e in events)
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    partial = "".join(
        d["delta"]["partial_json"]
        for d in datas
        if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == {"path": "/x", "all": True}
    text = "".join(
        d["delta"]["text"]
        for d in datas
        if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta"
    )
    assert text == REPLY.content
    assert (
        datas[-2]["delta"]["stop_reason"] == "tool_use" and datas[-2]["usage"]["output_tokens"] == 9
    )


def test_openai_sse_chunks_end_with_done() -> None:
    lines = list(openai_api.stream_chunks(REPLY, include_usage=True))
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    args = "".join(
        tc["function"].get("arguments", "")
        for c in chunks
        for ch in c["choices"]
        for tc in ch["delta"].get("tool_calls", [])
    )
    assert args == REPLY.tool_calls[0].arguments
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["total_tokens"] == 16


# -- tool-call parsing: property test against a reference ---------------------------------------

NAMES = ["ls", "read"]
NAMED = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in NAMES]
ARGS = st.dictionaries(
    st.sampled_from(["a", "b", "path"]), st.integers() | st.text(max_size=5), max_size=3
)


@st.composite
def outputs(draw: Any) -> tuple[str, list[tuple[str, str]], str]:
    """(model output, expected calls, expected text) built from good/bad segments.

    Reference: with no bad block, the calls in order and the text between them (each piece
    stripped, empty ones dropped, joined by newlines); any bad block (invalid JSON, unknown
    tool) makes the whole output plain text with no calls."""
    parts, calls, texts, bad = [], [], [], False
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "good", "bad_json", "bad_name"]))
        if kind == "text":
            t = draw(st.text(alphabet="abc xyz\n", max_size=10))
            parts.append(t)
            texts.append(t)
        elif kind == "good":
            name, args = draw(st.sampled_from(NAMES)), draw(ARGS)
            parts.append(
                f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
            )
            calls.append((name, json.dumps(args, ensure_ascii=False)))
            texts.append("\x00")  # a boundary between text pieces
        else:
            bad = True
            inner = (
                '{"name": "ls", "arguments": {'
                if kind == "bad_json"
                else '{"name": "rm", "arguments": {}}'
            )
            parts.append(f"<tool_call>{inner}</tool_call>")
    text = "".join(parts)
    if bad or not calls:
        return text, [], text.strip()
    pieces = [p.strip() for p in "".join(texts).split("\x00")]
    return text, calls, "\n".join(p for p in pieces if p)


@settings(max_examples=300, deadline=None)
@given(case=outputs())
def test_parse_output_matches_reference(case: tuple[str, list[tuple[str, str]], str]) -> None:
    text, calls, rest = case
    got_text, got_calls = parse_output(text, NAMED, HERMES)
    assert got_calls == calls
    assert got_text == rest


@pytest.fixture(scope="module")
def grammars() -> tuple[Any, GrammarCompiler]:
    tok = tiny_tokenizer()
    return tok, GrammarCompiler(tok, len(tok))


def _accepts(grammars: tuple[Any, GrammarCompiler], lark: str, text: str) -> bool:
    import llguidance

    tok, compiler = grammars
    matcher = llguidance.LLMatcher(compiler.tokenizer(), compiler.compile(Grammar("ebnf", lark)))
    ids = [*compiler.tokenizer().tokenize_str(text), tok.eos_token_id]
    return matcher.validate_tokens(ids) == len(ids)


def test_forced_grammar_accepts_schema_shaped_calls_only(grammars: Any) -> None:
    lark = forced_call_grammar(HERMES, TOOLS, None, 16)
    good = '<tool_call>\n{"name": "ls", "arguments": {"path": "a b", "all": true, "depth": 3, "mode": "b", "ratio": -0.5}}\n</tool_call>'
    assert _accepts(grammars, lark, good)
    assert _accepts(
        grammars,
        lark,
        '<tool_call>\n{"name": "free", "arguments": {"k": "v", "n": 1}}\n</tool_call>',
    )
    nested = '<tool_call>\n{"name": "nested", "arguments": {"opts": {"k": "z"}, "xs": [1, 2]}}\n</tool_call>'
    assert _accepts(grammars, lark, nested)
    assert _accepts(grammars, lark, nested.replace('"z"', '"z☃é"'))  # any Unicode
    assert not _accepts(grammars, lark, good.replace('"ls"', '"rm"'))
    assert not _accepts(grammars, lark, good.replace("true", '"yes"'))
    assert not _accepts(grammars, lark, good.replace('"a b"', '"' + "x" * 17 + '"'))
    assert not _accepts(grammars, lark, nested.replace('"z"}', '"z", "extra": 1}'))
    only = forced_call_grammar(HERMES, TOOLS, "free", 16)
    assert not _accepts(grammars, only, good)
    assert _accepts(grammars, only, '<tool_call>\n{"name": "free", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize(
    ("fmt", "value"),
    [(HERMES, "a</tool_call>b"), (HERMES, "{x}\n</tool_call>"), (LLAMA3_JSON, "a};b")],
)
def test_a_forced_call_whose_argument_holds_the_close_marker_stays_one_call(
    grammars: Any, fmt: Any, value: str
) -> None:
    """The forced grammar lets a string argument hold the format's close marker (seen from the
    tiny engine about once in 600 forced calls); read as text, the call is cut there and the
    client got no call for tool_choice "required". A forced output is read whole."""
    key = "arguments" if fmt is HERMES else "parameters"
    body = json.dumps({"name": "free", key: {"k": value}})
    text = f"<tool_call>\n{body}\n</tool_call>" if fmt is HERMES else body
    assert _accepts(grammars, forced_call_grammar(fmt, TOOLS, "free", 16), text)
    assert parse_output(text, TOOLS, fmt) == (text, [])  # the text parser cuts it
    expected = json.dumps({"k": value})
    assert parse_output(text, TOOLS, fmt, forced=True) == ("", [("free", expected)])
    cut = text[: len(text) - 3]  # max_tokens ended the forced call: plain text
    assert parse_output(cut, TOOLS, fmt, forced=True) == (cut.strip(), [])


def test_forced_grammar_names_added_token_markers(grammars: Any) -> None:
    tok, _ = grammars
    ids = {m: tok.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>")}
    lark = forced_call_grammar(HERMES, TOOLS, "free", 16, ids.get)
    assert f"<[{ids['<tool_call>']}]>" in lark and '"<tool_call>"' not in lark


@settings(max_examples=200, deadline=None)
@given(
    args=st.dictionaries(
        st.text(max_size=4), st.integers() | st.text(max_size=4) | st.booleans(), max_size=4
    ),
    indent=st.none() | st.integers(0, 3),
    sort=st.booleans(),
)
def test_restored_payloads_make_reserialized_calls_match(
    args: dict[str, Any], indent: int | None, sort: bool
) -> None:
    recorded = json.dumps(args, ensure_ascii=False)
    reply = matching.reply_message("t", [ToolCall(id="call_1", name="f", arguments=recorded)])
    conv = Conversation(system="s", tools=[], messages=[Message(role="user", content="u")])
    key = matching.chain(matching.chain_keys("m", conv)[-1], matching.message_digest(reply))
    sent = json.dumps(args, indent=indent, sort_keys=sort)
    conv.messages.append(
        Message(
            role="assistant",
            content=" t\n",
            tool_calls=[ToolCall(id="call_1", name="f", arguments=sent)],
        )
    )
    assert matching.restore_payloads(conv, {"call_1": ("f", recorded)}) == 1
    assert matching.chain_keys("m", conv)[-1] == key
    conv.messages[-1].content = "other"
    assert matching.chain_keys("m", conv)[-1] != key


def test_cli_engine_specs_and_admin_token(tmp_path: Any) -> None:
    from gyre.errors import ConfigError
    from gyre.proxy.cli import admin_token, parse_engines

    assert parse_engines(["http://a:1/", "b=http://b:2"]) == {"e0": "http://a:1", "b": "http://b:2"}
    for bad in (["ftp://x"], ["a=http://x", "a=http://y"], ["=http://x"]):
        with pytest.raises(ConfigError):
            parse_engines(bad)
    path = tmp_path / "sub" / "token"
    token = admin_token(str(path))
    assert len(token) >= 16 and admin_token(str(path)) == token
    path.write_text("short")
    with pytest.raises(ConfigError):
        admin_token(str(path))


def test_config_rejects_bad_values_naming_the_key() -> None:
    from gyre.config import load
    from gyre.errors import ConfigError
    from gyre.proxy.config import Config

    cfg = load(
        Config, {"model_names": ["a"], "role_rules": [{"role": "compaction", "pattern": "x"}]}
    )
    assert cfg.role_rules[0].source == "last_user"
    bad = [
        ({"model_names": []}, "model_names"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"role_rules": [{"role": "bad role", "pattern": "x"}]}, "role"),
        ({"role_rules": [{"role": "r", "pattern": "("}]}, "pattern"),
        ({"colour": "red"}, "colour"),
        ({"render_threads": 0}, "render_threads"),
    ]
    for data, name in bad:
        with pytest.raises(ConfigError, match=name):
            load(Config, data, "proxy")
