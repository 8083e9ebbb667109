"""The official openai / anthropic SDKs hold multi-turn tool conversations through the proxy.

Each conversation: a forced tool call (tool_choice required / any), a named tool call, then a
free turn; streaming and not. Checks: calls come back in each API's own shape, the
execution's tree is one linear path, turn k+1's engine input starts with turn k's whole
context + output verbatim (even when the client re-serializes tool arguments), and every
node's path tokens equal what the engine itself logged as received.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from conftest import MODEL, TOOLS, anthropic_tools, assert_paths_match_engine

from gyre.trajectory.tree import Provenance

SYSTEM = "You are a careful file agent."
OPENAI_CHOICES: list[Any] = ["required", {"type": "function", "function": {"name": "read"}}, "auto"]
ANTHROPIC_CHOICES: list[Any] = [{"type": "any"}, {"type": "tool", "name": "read"}, None]
MAX_TOKENS = [120, 120, 6]
ARG_NAMES = {"ls": {"path", "all"}, "read": {"file", "limit"}}


def shuffled_json(args: str) -> str:
    """What some clients do between turns: other key order, other spacing."""
    obj = json.loads(args)
    return json.dumps(dict(reversed(list(obj.items()))), indent=1, separators=(" ,", " :  "))


def openai_turn(
    client: openai.OpenAI, msgs: list[Any], choice: Any, max_tokens: int, stream: bool
) -> tuple[dict[str, Any], str]:
    kwargs = {
        "model": MODEL,
        "messages": msgs,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": max_tokens,
        "temperature": 1.0,
    }
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
    content, calls, finish = "", {}, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] += tc.id or ""
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def check_linear(p: Any, execution_id: str, turns: int) -> None:
    tree = p.call(p.app.tree, execution_id)
    assert [(n.node_id, n.parent_id) for n in tree.nodes] == [
        (k, k - 1) for k in range(1, turns + 1)
    ]
    for k in range(1, turns):
        before = p.call(tree.full_ids, k)
        after = p.call(tree.context_ids, k + 1)
        assert np.array_equal(after[: len(before)], before)  # turn k's output ids verbatim
        assert tree.node(k + 1).input_provenance.min() > Provenance.POLICY
    assert tree.node(1).input_provenance[0] == Provenance.TEMPLATE


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_tool_conversation(proxy: Any, engine_url: str, stream: bool) -> None:
    key = proxy.call(proxy.app.register_execution, f"oa-{stream}", "main")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    msgs: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "List the folder, then read a file."},
    ]
    for turn, (choice, max_tokens) in enumerate(zip(OPENAI_CHOICES, MAX_TOKENS)):
        message, finish = openai_turn(client, msgs, choice, max_tokens, stream)
        msgs.append(message)
        if turn < 2:
            assert finish == "tool_calls"
            (call,) = message["tool_calls"]
            assert call["id"].startswith("call_")
            name = call["function"]["name"]
            assert name in (("ls", "read") if turn == 0 else ("read",))
            assert set(json.loads(call["function"]["arguments"])) == ARG_NAMES[name]
            call["function"]["arguments"] = shuffled_json(call["function"]["arguments"])
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "a.txt\nb.txt"})
        else:
            assert finish in ("stop", "length", "tool_calls")
    check_linear(proxy, f"oa-{stream}", 3)
    assert assert_paths_match_engine(proxy, f"oa-{stream}", engine_url) == 3


def anthropic_turn(
    client: anthropic.Anthropic, msgs: list[Any], choice: Any, max_tokens: int, stream: bool
) -> Any:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": msgs,
        "tools": anthropic_tools(),
        "max_tokens": max_tokens,
    }
    if choice is not None:
        kwargs["tool_choice"] = choice
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_tool_conversation(proxy: Any, engine_url: str, stream: bool) -> None:
    key = proxy.call(proxy.app.register_execution, f"an-{stream}", "main")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "List, then read."}]}]
    for turn, (choice, max_tokens) in enumerate(zip(ANTHROPIC_CHOICES, MAX_TOKENS)):
        reply = anthropic_turn(client, msgs, choice, max_tokens, stream)
        blocks = [b.model_dump(exclude_none=True) for b in reply.content]
        msgs.append({"role": "assistant", "content": blocks})
        if turn < 2:
            assert reply.stop_reason == "tool_use"
            uses = [b for b in blocks if b["type"] == "tool_use"]
            assert len(uses) == 1 and uses[0]["id"].startswith("toolu_")
            assert uses[0]["name"] in (("ls", "read") if turn == 0 else ("read",))
            assert set(uses[0]["input"]) == ARG_NAMES[uses[0]["name"]]
            uses[0]["input"] = dict(reversed(list(uses[0]["input"].items())))
            msgs.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": uses[0]["id"],
                            "content": [{"type": "text", "text": "a.txt"}],
                        },
                        {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}},
                    ],
                }
            )
        else:
            assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
            assert reply.usage.output_tokens >= 1
    check_linear(proxy, f"an-{stream}", 3)
    assert assert_paths_match_engine(proxy, f"an-{stream}", engine_url) == 3


def test_models_list_and_head(proxy: Any) -> None:
    key = proxy.call(proxy.app.register_execution, "models", "main")
    ids = [m.id for m in openai.OpenAI(base_url=proxy.url + "/v1", api_key=key).models.list()]
    assert ids == [MODEL]
    listed = anthropic.Anthropic(base_url=proxy.url, api_key=key).models.list()
    assert [m.id for m in listed] == [MODEL]
    import urllib.request

    req = urllib.request.Request(proxy.url + "/", method="HEAD")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_long_inputs_render_off_the_loop_and_match(proxy: Any, engine_url: str) -> None:
    """New input over 8192 characters is tokenized in a worker thread: same exact tokens."""
    key = proxy.call(proxy.app.register_execution, "long", "main")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": "read this: " + "lorem ipsum dolor " * 600}]
    for _ in range(2):
        message, _finish = openai_turn(client, msgs, "auto", 3, stream=False)
        msgs += [message, {"role": "user", "content": "and this: " + "sit amet " * 1200}]
    check_linear(proxy, "long", 2)
    assert assert_paths_match_engine(proxy, "long", engine_url) == 2


def test_call_is_recorded_even_if_answering_the_harness_fails(proxy: Any) -> None:
    """The reply goes out before the node is recorded; a failed send loses no node."""
    from gyre.proxy.openai_api import parse_request

    proxy.call(proxy.app.register_execution, "gone", "main")
    service = proxy.app.service
    ex = service.execution("gone")
    req = parse_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    sent: list[Any] = []

    def respond(reply: Any) -> None:
        sent.append(reply)
        assert len(ex.tree) == 0  # answered before recording
        raise ConnectionResetError("the harness went away")

    with pytest.raises(ConnectionResetError):
        proxy.run(service.serve(ex, req, respond=respond))
    assert len(sent) == 1 and len(ex.tree) == 1
    node = ex.tree.node(1)
    assert node.parent_id == 0 and len(node.output_ids) == sent[0].completion_tokens


def test_seeded_calls_repeat_and_differ_by_execution_and_index(
    engine_url: str, tokenizer: Any
) -> None:
    """With a sampling seed, the same call (execution id, index) samples the same tokens at
    temperature 1 from the same weights; another execution or another index samples others."""
    from gyre.proxy.config import Config
    from gyre.proxy.service import call_seed
    from gyre.proxy.testing import running_proxy

    def outputs(seed: int | None, eid: str) -> list[list[int]]:
        config = Config(model_names=["gyre-tiny"], sampling_seed=seed)
        with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
            key = p.call(p.app.register_execution, eid, "main")
            client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
            for _ in range(2):  # two calls with one and the same prompt: indices 1 and 2
                client.chat.completions.create(
                    model="gyre-tiny", messages=[{"role": "user", "content": "Say something."}],
                    max_tokens=12, temperature=1.0,
                )  # fmt: skip
            return [n.output_ids.tolist() for n in p.call(p.app.tree, eid).nodes]

    first, again = outputs(7, "seeded"), outputs(7, "seeded")
    assert first == again  # the run is repeatable call by call
    assert first[0] != first[1]  # the call's index is part of its seed
    assert outputs(7, "other")[0] != first[0]  # so is the execution
    assert outputs(8, "seeded")[0] != first[0]  # and the run's seed
    assert call_seed(None, "seeded", 1) is None  # no seed: the engine draws a fresh one
    assert 0 <= call_seed(7, "seeded", 1) < 2**63  # type: ignore[operator]
