"""Tool-call formats per model family, through the proxy and TITO.

For each format the tokenizer carries a chat template that renders calls that way (Gyre's
Hermes template; test templates in Qwen3-Coder's XML and Llama 3's JSON layouts, written
here in ChatML framing for the tiny vocabulary). The format is detected from the template;
a scripted policy answers with a call in that format, the `openai` SDK receives it parsed,
re-sends it with its arguments re-serialized, and the next call must continue the recorded
node with every path equal to what the engine received. Against the real tiny engine, a
forced call (tool_choice "required") decoded under each format's grammar parses into a
call with schema-valid arguments.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import MODEL, TOOLS, assert_paths_match

from gyre.models import tiny_tokenizer, tool_format
from gyre.proxy.config import Config
from gyre.proxy.testing import ScriptedEngine, running_proxy

HEADER = """{%- if tools -%}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}"""


def _chatml(calls: str, tool_turn: str) -> str:
    """A ChatML chat template (HEADER first) writing an assistant turn's calls with `calls`
    (the body of a loop over them, closed) and a tool result as the turn `tool_turn`."""
    return (
        HEADER
        + """{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'assistant' -%}<|im_start|>assistant
{{ m.content }}
{%- for c in m.tool_calls or [] %}"""
        + calls
        + """<|im_end|>
{% elif m.role == 'tool' -%}<|im_start|>"""
        + tool_turn
        + """<|im_end|>
{% else -%}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
    )


QWEN3_CODER = _chatml(
    """
<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}""",
    "user\n<tool_response>\n{{ m.content }}\n</tool_response>",
)
LLAMA3_JSON = _chatml(
    """{{ '; ' if not loop.first }}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}""",
    "ipython\n{{ m.content }}",
)
ARGS = {"path": "src/é", "all": True}
REPLIES = {
    "hermes": f"<tool_call>\n{json.dumps({'name': 'ls', 'arguments': ARGS})}\n</tool_call>",
    "qwen3_coder": (
        "Looking.\n<tool_call>\n<function=ls>\n<parameter=path>\nsrc/é\n</parameter>\n"
        "<parameter=all>\ntrue\n</parameter>\n</function>\n</tool_call>"
    ),
    "llama3_json": json.dumps({"name": "ls", "parameters": ARGS}),
}
TEMPLATES = {"hermes": None, "qwen3_coder": QWEN3_CODER, "llama3_json": LLAMA3_JSON}


def _tokenizer(fmt: str) -> Any:
    tok = tiny_tokenizer()
    if TEMPLATES[fmt] is not None:
        tok.chat_template = TEMPLATES[fmt]
    return tok


def _resend(message: Any) -> dict[str, Any]:
    """The assistant message as a client sends it back: arguments re-serialized."""
    (call,) = message.tool_calls
    args = json.dumps(json.loads(call.function.arguments), sort_keys=True, indent=2)
    return {
        "role": "assistant",
        "content": message.content,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "ls", "arguments": args}}
        ],
    }


@pytest.mark.parametrize("fmt", list(REPLIES))
def test_format_round_trip_continues_the_recorded_node(fmt: str) -> None:
    tok = _tokenizer(fmt)
    assert tool_format(tok) == fmt
    engine = ScriptedEngine(tok, [REPLIES[fmt], "Two files."])
    with running_proxy({"e0": engine}, tokenizer=tok, config=Config(model_names=[MODEL])) as p:
        key = p.call(p.app.register_execution, f"fmt-{fmt}", "main")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        msgs: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "ls"}]
        first = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        (call,) = first.choices[0].message.tool_calls or []
        assert call.function.name == "ls" and json.loads(call.function.arguments) == ARGS
        assert first.choices[0].finish_reason == "tool_calls"
        msgs += [
            _resend(first.choices[0].message),
            {"role": "tool", "tool_call_id": call.id, "content": "a b"},
        ]
        second = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        assert second.choices[0].message.content == "Two files."
        assert [n.parent_id for n in p.call(p.app.tree, f"fmt-{fmt}").nodes] == [0, 1]
        assert assert_paths_match(p, f"fmt-{fmt}", engine.requests) == 2


def _forced_call(
    engine: Any, tok: Any, config: Config, execution_id: str, content: str, **extra: Any
) -> Any:
    """The reply to one user message `content` with TOOLS and tool_choice "required", sent
    through a proxy over `engine`."""
    with running_proxy({"e0": engine}, tokenizer=tok, config=config) as p:
        key = p.call(p.app.register_execution, execution_id, "main")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            tools=TOOLS,
            tool_choice="required",
            **extra,
        )


@pytest.mark.parametrize("fmt", list(REPLIES))
def test_forced_call_in_each_format_from_the_real_engine(fmt: str, engine_url: str) -> None:
    tok = _tokenizer(fmt)
    config = Config(model_names=[MODEL], max_tokens_cap=200)
    reply = _forced_call(
        engine_url, tok, config, f"forced-{fmt}", "read it", max_tokens=200, seed=3
    )
    (call,) = reply.choices[0].message.tool_calls or []
    args = json.loads(call.function.arguments)
    schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    params = schema["function"]["parameters"]
    assert set(args) == set(params["required"])
    for name, value in args.items():
        kind = params["properties"][name]["type"]
        assert isinstance(value, {"string": str, "boolean": bool, "integer": int}[kind])


@pytest.mark.smollm2
def test_a_marker_the_vocabulary_lacks_is_spelled_out_not_its_unknown_token() -> None:
    """SmolLM2 has no <tool_call> token and its unknown token is an added one
    (<|endoftext|>): a forced call must be written with the literal marker, or the output
    carries <|endoftext|> where the parser looks for <tool_call> and the call is lost."""
    from gyre.models import load_tokenizer
    from gyre.proxy.service import marker_token

    tok = load_tokenizer("smollm2-135m")
    assert marker_token(tok, "<tool_call>") is None
    im_end = marker_token(tok, "<|im_end|>")
    assert im_end is not None and tok.convert_ids_to_tokens(im_end) == "<|im_end|>"


def test_a_forced_call_holding_its_close_marker_reaches_the_client_whole() -> None:
    """tool_choice "required": the proxy reads the output as the grammar's one call (the
    scripted engine stands in for a sample the grammar allows), so an argument holding
    `</tool_call>` comes back whole, not as text."""
    tok = _tokenizer("hermes")
    args = {"path": "x</tool_call>y", "all": False}
    reply = f"<tool_call>\n{json.dumps({'name': 'ls', 'arguments': args})}\n</tool_call>"
    engine = ScriptedEngine(tok, [reply])
    out = _forced_call(engine, tok, Config(model_names=[MODEL]), "forced-marker", "ls")
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == args
