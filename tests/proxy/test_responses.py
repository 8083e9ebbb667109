"""The OpenAI Responses API (`POST /v1/responses`) through a real proxy and the openai SDK.

A scripted engine stands in for a policy that calls tools on cue; the proxy, its TITO
matching and the SDK are real. Each multi-turn conversation re-sends the function call with
its arguments re-serialized (other spacing and key order), and must still continue the
recorded node, with every node's path equal to what the engine received.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import MODEL, TOOLS, assert_paths_match, assert_paths_match_engine

from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, ScriptedEngine, running_proxy

CALL = '<tool_call>\n{"name": "ls", "arguments": {"path": "src", "all": false}}\n</tool_call>'
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture
def scripted(tokenizer: Any) -> Iterator[tuple[RunningProxy, ScriptedEngine]]:
    engine = ScriptedEngine(tokenizer, [CALL, "There are two files."])
    config = Config(model_names=[MODEL])
    with running_proxy({"e0": engine}, tokenizer=tokenizer, config=config) as p:
        yield p, engine


def _client(p: RunningProxy, execution_id: str) -> openai.OpenAI:
    key = p.call(p.app.register_execution, execution_id, "main")
    return openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)


def _history(call: Any) -> list[dict[str, Any]]:
    """The function call as a client re-sends it: arguments re-serialized."""
    args = json.dumps(json.loads(call.arguments), indent=1, sort_keys=True)
    return [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": args},
        {"type": "function_call_output", "call_id": call.call_id, "output": "a.py\nb.py"},
    ]


def test_tool_round_trip_continues_the_recorded_node(scripted: Any) -> None:
    p, engine = scripted
    client = _client(p, "r-1")
    first = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "ls src"}]
    r1 = client.responses.create(model=MODEL, input=first, tools=FUNCTIONS)
    assert r1.status == "completed" and r1.id.startswith("resp_")
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "ls"
    assert json.loads(call.arguments) == {"path": "src", "all": False}
    r2 = client.responses.create(model=MODEL, input=first + _history(call), tools=FUNCTIONS)
    assert r2.output_text == "There are two files."
    assert r2.usage is not None and r2.usage.input_tokens > r1.usage.input_tokens  # type: ignore[union-attr]
    tree = p.call(p.app.tree, "r-1")
    assert [n.parent_id for n in tree.nodes] == [0, 1]
    assert assert_paths_match(p, "r-1", engine.requests) == 2


def test_streamed_events_follow_the_api_sequence(scripted: Any) -> None:
    p, _ = scripted
    client = _client(p, "r-2")
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "ls"}]}]
    with client.responses.stream(model=MODEL, input=msgs, tools=FUNCTIONS) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert events == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = final.output
    follow = msgs + _history(call)
    with client.responses.stream(model=MODEL, input=follow, tools=FUNCTIONS) as stream:
        kinds = [e.type for e in stream]
        answer = stream.get_final_response()
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert answer.output_text == "There are two files."
    assert [n.parent_id for n in p.call(p.app.tree, "r-2").nodes] == [0, 1]


def test_namespaced_tools_are_answered_with_their_namespace(tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "agents.spawn", "arguments": {"task": "x"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "ok"])
    spawn = {"type": "function", "name": "spawn", "parameters": {"type": "object"}}
    tools = [{"type": "namespace", "name": "agents", "description": "d", "tools": [spawn]}]
    with running_proxy(
        {"e0": engine}, tokenizer=tokenizer, config=Config(model_names=[MODEL])
    ) as p:
        key = p.call(p.app.register_execution, "r-ns", "main")
        body = {"model": MODEL, "input": "go", "tools": [*tools, {"type": "web_search"}]}
        out = _post(p, key, body)["output"][0]
        assert (out["namespace"], out["name"]) == ("agents", "spawn")
        item = {k: out[k] for k in ("type", "call_id", "name", "namespace", "arguments")}
        result = {"type": "function_call_output", "call_id": out["call_id"], "output": "done"}
        body["input"] = [{"role": "user", "content": "go"}, item, result]
        assert _post(p, key, body)["output"][0]["content"][0]["text"] == "ok"
        assert [n.parent_id for n in p.call(p.app.tree, "r-ns").nodes] == [0, 1]


def _post(p: RunningProxy, key: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        p.url + "/v1/responses",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return dict(json.load(r))


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "computer_call"}]}, "computer_call"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "o"}]}, "nope"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "rm"}}, "rm"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_requests_get_400_in_openai_shape(
    scripted: Any, body: dict[str, Any], needle: str
) -> None:
    p, _ = scripted
    client = _client(p, "r-bad")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, tools=FUNCTIONS, **body)
    assert needle in err.value.message
    assert len(p.call(p.app.tree, "r-bad")) == 0


def test_unknown_model_and_key(scripted: Any) -> None:
    p, _ = scripted
    with pytest.raises(openai.NotFoundError):
        _client(p, "r-404").responses.create(model="other", input="x")
    bad = openai.OpenAI(base_url=p.url + "/v1", api_key="gyre-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=MODEL, input="x")


def test_real_engine_cut_output_is_incomplete(proxy: RunningProxy, engine_url: str) -> None:
    client = _client(proxy, "r-real")
    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.output_tokens == 4
    assert assert_paths_match_engine(proxy, "r-real", engine_url) == 1
