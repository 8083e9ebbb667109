"""Bad input gets a 4xx in the API's own error shape and changes no tree.

Named cases per API (malformed JSON, missing / mistyped fields, unknown model, body over the
limit, no key, another execution's key, a tool result for an unknown call id, a closed
execution's key), then a property-based fuzz: a few thousand generated and mutated requests
against a live proxy, never a 5xx, the server still answering, and the only tree changes
are the nodes of requests that got 200.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
from conftest import MODEL, TOOLS, anthropic_tools
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, running_proxy

OA_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 1,
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x"},
    ],
}
AN_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 1,
    "tools": anthropic_tools(),
    "system": [{"type": "text", "text": "s"}],
    "messages": [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}],
        },
    ],
}
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
BODIES = {"openai": OA_BODY, "anthropic": AN_BODY}


@dataclass
class Response:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def post(
    p: RunningProxy,
    api: str,
    body: Any = None,
    key: str | None = None,
    *,
    prefix: str = "",
    raw: bytes | None = None,
) -> Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["x-api-key" if api == "anthropic" else "authorization"] = (
            key if api == "anthropic" else f"Bearer {key}"
        )
    data = raw if raw is not None else json.dumps(body).encode()
    url = urllib.parse.urlsplit(p.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", prefix + PATHS[api], body=data, headers=headers)
        r = conn.getresponse()
        return Response(r.status, r.read().decode())
    finally:
        conn.close()


def check_shape(api: str, r: Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    if api == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["message"]
    else:
        assert body["type"] == "error" and body["error"]["type"] == kind
        assert body["error"]["message"]


def nodes(p: RunningProxy) -> dict[str, int]:
    return p.call(lambda: {e: len(x.tree) for e, x in p.app.service.executions.items()})


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_named_bad_requests(proxy: RunningProxy, api: str) -> None:
    key = proxy.call(proxy.app.register_execution, f"bad-{api}")
    other = proxy.call(proxy.app.register_execution, f"other-{api}")
    base = BODIES[api]
    before = nodes(proxy)
    cases = [
        (dict(raw=b'{"model": "x", '), 400, "invalid_request_error"),
        (
            dict(body={k: v for k, v in base.items() if k != "messages"}),
            400,
            "invalid_request_error",
        ),
        (dict(body={**base, "max_tokens": "many"}), 400, "invalid_request_error"),
        (dict(body={**base, "messages": "hello"}), 400, "invalid_request_error"),
        (dict(body={**base, "model": "no-such-model"}), 404, "not_found_error"),
        (
            dict(body={**base, "messages": [{"role": "user", "content": "x" * 300_000}]}),
            413,
            "request_too_large",
        ),
    ]
    for kwargs, status, kind in cases:
        check_shape(api, post(proxy, api, key=key, **kwargs), status, kind)  # type: ignore[arg-type]
    check_shape(api, post(proxy, api, base, None), 401, "authentication_error")
    check_shape(api, post(proxy, api, base, "gyre-wrong"), 401, "authentication_error")
    check_shape(api, post(proxy, api, base, other, prefix=f"/e/bad-{api}"), 403, "permission_error")
    unknown = json.loads(json.dumps(base).replace("call_1", "call_X").replace("toolu_1", "toolu_X"))
    unknown["messages"] = [m for m in unknown["messages"] if m["role"] != "assistant"]
    check_shape(api, post(proxy, api, unknown, key), 400, "invalid_request_error")
    assert nodes(proxy) == before
    # a request for its own execution under the pinned prefix works
    assert post(proxy, api, base, key, prefix=f"/e/bad-{api}").status_code == 200
    proxy.call(proxy.app.close_execution, f"bad-{api}", "completed")
    check_shape(api, post(proxy, api, base, key), 401, "authentication_error")


def test_sdk_errors_raise_typed_exceptions(proxy: RunningProxy) -> None:
    key = proxy.call(proxy.app.register_execution, "sdk-errors")
    oa = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="nope", max_retries=0
        ).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}])
    an = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_never", "content": "x"}
                    ],
                }
            ],
        )
    assert "toolu_never" in str(e.value)
    assert nodes(proxy)["sdk-errors"] == 0


# -- fuzz -------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 10**12)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def mutated(draw: Any, base: dict[str, Any]) -> Any:
    """The base body with a few random edits deep inside (delete, replace, retype, wrap)."""
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        parent, where = body, None
        node: Any = body
        for _depth in range(draw(st.integers(0, 4))):
            keys = (
                list(node)
                if isinstance(node, dict)
                else list(range(len(node)))
                if isinstance(node, list)
                else []
            )
            if not keys:
                break
            where = draw(st.sampled_from(keys))
            parent, node = node, node[where]
        if where is None:
            continue
        op = draw(st.sampled_from(["delete", "replace", "wrap", "stringify"]))
        if op == "delete" and isinstance(parent, dict):
            del parent[where]
        elif op == "wrap":
            parent[where] = [node]
        elif op == "stringify":
            parent[where] = json.dumps(node)
        else:
            parent[where] = draw(JSON)
    return body


@pytest.fixture(scope="module")
def fuzz_proxy(engine_url: str, tokenizer: Any) -> Iterator[RunningProxy]:
    config = Config(
        model_names=[MODEL],
        max_body_bytes=64 * 1024,
        max_tokens_cap=2,
        max_context_tokens=4096,
        reroute_wait_s=2.0,
    )
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        yield p


STATS: dict[str, int] = {"ok": 0, "sent": 0}


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), api=st.sampled_from(["openai", "anthropic"]))
def test_fuzzed_requests_never_5xx(fuzz_proxy: RunningProxy, data: Any, api: str) -> None:
    key = fuzz_proxy.call(lambda: fuzz_proxy.app.service.executions.get("fuzz"))
    key = key.key if key else fuzz_proxy.call(fuzz_proxy.app.register_execution, "fuzz")
    mode = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "bytes", "json"]))
    raw = None
    if mode == "mutate":
        body = data.draw(mutated(BODIES[api]))
    elif mode == "json":
        body = data.draw(JSON)
    else:
        text = json.dumps(BODIES[api]).encode()
        cut = data.draw(st.integers(0, len(text)))
        raw = text[:cut] + data.draw(st.binary(max_size=8))
        body = None
    r = post(fuzz_proxy, api, body, key, raw=raw)
    assert r.status_code < 500, r.text
    assert r.status_code in (200, 400, 404, 413), r.text
    STATS["sent"] += 1
    STATS["ok"] += r.status_code == 200
    tree_size = fuzz_proxy.call(lambda: len(fuzz_proxy.app.tree("fuzz")))
    assert tree_size == STATS["ok"]  # only accepted calls became nodes


def test_fuzz_reached_the_engine() -> None:
    """Runs after the fuzz (file order): it sent thousands of requests, some were served."""
    if STATS["sent"] == 0:
        pytest.skip("the fuzz test did not run in this session")
    assert STATS["sent"] >= 1000 and 0 < STATS["ok"] < STATS["sent"], STATS
