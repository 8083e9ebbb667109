"""Bad input gets a 4xx in the API's own error shape (or a documented coercion), never a 5xx.

Named cases per API (malformed JSON, missing / mistyped fields, unknown model, body over the
limit, no key, another execution's key, a tool result for an unknown call id, a closed
execution's key), then input hardening: lone UTF-16 surrogates anywhere (coerced to U+FFFD,
served, recorded), NaN / Infinity / overflowing numbers and non-UTF-8 bytes (400), numbers
out of range (400; a huge max_tokens is capped), nesting beyond 100 levels in free-form JSON
(400), malformed tool schemas (400), the same for the admin routes. `test_fuzz.py` throws
10,000 generated and mutated requests at a live proxy.
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
from test_admin import admin

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
RS_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_output_tokens": 1,
    "tools": [{"type": "function", **t["function"]} for t in TOOLS],
    "instructions": "s",
    "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "x"},
    ],
}
PATHS = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}
BODIES = {"openai": OA_BODY, "anthropic": AN_BODY, "responses": RS_BODY}
APIS = ["openai", "anthropic", "responses"]
MSGS = {"openai": "messages", "anthropic": "messages", "responses": "input"}
MAXTOK = {"openai": "max_tokens", "anthropic": "max_tokens", "responses": "max_output_tokens"}


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
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == kind
        assert body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["message"]


def nodes(p: RunningProxy) -> dict[str, int]:
    return p.call(lambda: {e: len(x.tree) for e, x in p.app.service.executions.items()})


@pytest.mark.parametrize("api", APIS)
def test_named_bad_requests(proxy: RunningProxy, api: str) -> None:
    key = proxy.call(proxy.app.register_execution, f"bad-{api}")
    other = proxy.call(proxy.app.register_execution, f"other-{api}")
    base = BODIES[api]
    before = nodes(proxy)
    cases = [
        (dict(raw=b'{"model": "x", '), 400, "invalid_request_error"),
        (
            dict(body={k: v for k, v in base.items() if k != MSGS[api]}),
            400,
            "invalid_request_error",
        ),
        (dict(body={**base, MAXTOK[api]: "many"}), 400, "invalid_request_error"),
        (dict(body={**base, MSGS[api]: 5}), 400, "invalid_request_error"),
        (dict(body={**base, "model": "no-such-model"}), 404, "not_found_error"),
        (
            dict(body={**base, MSGS[api]: [{"role": "user", "content": "x" * 300_000}]}),
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
    if api == "responses":
        unknown["input"] = [i for i in unknown["input"] if i.get("type") != "function_call"]
    else:
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


# -- input hardening -----------------------------------------------------------------------------

TEXT_KEYS = {"content", "text", "system", "description", "instructions", "output"}


def with_surrogates(value: Any, key: str = "") -> Any:
    """Every free text of a body with a lone surrogate appended (JSON then escapes it)."""
    if isinstance(value, dict):
        return {k: with_surrogates(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [with_surrogates(v, key) for v in value]
    if isinstance(value, str) and key in TEXT_KEYS:
        return value + "\ud800"
    if key == "arguments":  # inside the arguments' own JSON text
        return json.dumps({"path": "\udfff"})
    if key == "input" and isinstance(value, dict):
        return {"path": "\udc00"}
    return value


@pytest.mark.parametrize("api", APIS)
def test_lone_surrogates_become_replacement_characters(
    proxy: RunningProxy, tokenizer: Any, api: str
) -> None:
    key = proxy.call(proxy.app.register_execution, f"sur-{api}")
    body = with_surrogates(BODIES[api])
    body["tools"][0][
        {"openai": "function", "anthropic": "input_schema", "responses": "parameters"}[api]
    ]["x-note\udbff"] = "k"  # a key too
    raw = json.dumps(body).encode()
    assert b"\\ud800" in raw  # the escape, as JSON.stringify writes a cut surrogate pair
    for _ in range(2):
        r = post(proxy, api, key=key, raw=raw)
        assert r.status_code == 200, r.text
    tree = proxy.call(proxy.app.tree, f"sur-{api}")
    first, again = tree.nodes
    text = tokenizer.decode(first.input_ids.tolist())
    assert text.count("\ufffd") >= 3 and "\ud800" not in text, text
    assert again.input_key == first.input_key  # the same bytes decode to the same text


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"1" * 5000])
def test_numbers_json_does_not_have_are_refused(
    proxy: RunningProxy, api: str, literal: bytes
) -> None:
    key = proxy.call(proxy.app.register_execution, f"nan-{api}-{literal[:8].hex()}")
    for field in ("temperature", "metadata"):  # a sampling field, and one the proxy ignores
        raw = json.dumps({**BODIES[api], field: "@"}).encode().replace(b'"@"', literal)
        r = post(proxy, api, key=key, raw=raw)
        check_shape(api, r, 400, "invalid_request_error")
        assert "JSON" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def capped(engine_url: str, tokenizer: Any) -> Iterator[RunningProxy]:
    """A proxy that caps max_tokens at 3."""
    config = Config(model_names=[MODEL], max_tokens_cap=3)
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        yield p


@pytest.mark.parametrize("api", APIS)
def test_numbers_out_of_range(capped: RunningProxy, api: str) -> None:
    proxy = capped
    key = proxy.call(proxy.app.register_execution, f"range-{api}")
    base = BODIES[api]
    hi = 1.0 if api == "anthropic" else 2.0
    for field, value in [("temperature", 10**30), ("temperature", -0.5), ("temperature", hi + 0.1),
                         ("temperature", True), ("top_p", 0), ("top_p", 1.5), ("top_p", -(10**400)),
                         (MAXTOK[api], 0), (MAXTOK[api], -1), (MAXTOK[api], 1.0)]:  # fmt: skip
        r = post(proxy, api, {**base, field: value}, key)
        check_shape(api, r, 400, "invalid_request_error")
        assert field in r.json()["error"]["message"], r.text
    assert nodes(proxy)[f"range-{api}"] == 0
    r = post(proxy, api, {**base, MAXTOK[api]: 10**30, "temperature": 0}, key)  # capped
    assert r.status_code == 200, r.text
    assert len(proxy.call(proxy.app.tree, f"range-{api}").node(1).output_ids) <= 3


def _nested(levels: int, inner: Any) -> Any:
    for _ in range(levels - 1):
        inner = {"type": "array", "items": inner}
    return inner


@pytest.mark.parametrize("api", APIS)
def test_nesting_and_tool_schemas(proxy: RunningProxy, api: str) -> None:
    key = proxy.call(proxy.app.register_execution, f"deep-{api}")
    slot = {"openai": "function", "anthropic": "input_schema", "responses": "parameters"}[api]

    def with_schema(schema: dict[str, Any]) -> dict[str, Any]:
        body = json.loads(json.dumps(BODIES[api]))
        if slot == "function":
            body["tools"][0]["function"]["parameters"] = schema
        else:
            body["tools"][0][slot] = schema
        return body

    ok = post(proxy, api, with_schema(_nested(100, {"type": "string"})), key)
    assert ok.status_code == 200, ok.text  # 100 levels: allowed
    for schema in (_nested(101, {"type": "string"}), {"type": "object", "required": "path"},
                   {"type": "object", "properties": ["path"]},
                   {"type": "object", "required": [{"a": 1}]}):  # fmt: skip
        check_shape(api, post(proxy, api, with_schema(schema), key), 400, "invalid_request_error")
    deep = b"[" * 5000 + b"]" * 5000  # beyond the parser itself, in an ignored field
    raw = json.dumps({**BODIES[api], "metadata": "@"}).encode().replace(b'"@"', deep)
    check_shape(api, post(proxy, api, key=key, raw=raw), 400, "invalid_request_error")
    raw = json.dumps(BODIES[api]).encode().replace(b'"s"', b'"s\xff\xfe"', 1)  # not UTF-8
    r = post(proxy, api, key=key, raw=raw)
    check_shape(api, r, 400, "invalid_request_error")
    assert "UTF-8" in r.json()["error"]["message"]
    assert nodes(proxy)[f"deep-{api}"] == 1


def test_deep_tool_call_arguments_and_odd_forced_schemas(proxy: RunningProxy) -> None:
    key = proxy.call(proxy.app.register_execution, "args")
    deep_args = json.dumps(_nested(150, {}))
    body = json.loads(json.dumps(OA_BODY))
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = deep_args
    check_shape("openai", post(proxy, "openai", body, key), 400, "invalid_request_error")
    an = json.loads(json.dumps(AN_BODY))
    an["messages"][1]["content"][0]["input"] = _nested(150, {})
    check_shape("anthropic", post(proxy, "anthropic", an, key), 400, "invalid_request_error")
    # a forced call of a schema whose keywords have the wrong types: bounded, never a 5xx
    odd = {"type": "object", "properties": {"path": {"type": "string", "maxLength": "long"},
                                            "n": {"type": "integer", "minimum": "x"}},
           "required": ["path"]}  # fmt: skip
    tool = {"type": "function", "function": {"name": "odd", "parameters": odd}}
    forced = {"type": "function", "function": {"name": "odd"}}
    msgs = [{"role": "user", "content": "go"}]
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": msgs,
        "tools": [tool],
        "tool_choice": forced,
    }
    r = post(proxy, "openai", body, key)
    assert r.status_code in (200, 400), r.text  # served, or the engine refuses the grammar


def _admin_raw(p: RunningProxy, method: str, path: str, raw: bytes, **headers: str) -> Response:
    url = urllib.parse.urlsplit(p.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        conn.request(method, path, body=raw, headers={"authorization": f"Bearer {p.admin_token}",
                                                      **headers})  # fmt: skip
        r = conn.getresponse()
        return Response(r.status, r.read().decode())
    finally:
        conn.close()


def test_admin_input_hardening(proxy: RunningProxy) -> None:
    url, token = proxy.url, proxy.admin_token
    bad = [
        (b'{"execution_id": "a", "meta": {"x": NaN}}', "/admin/executions"),
        (b'{"execution_id": "a\\n"}', "/admin/executions"),
        (b'{"execution_id": "a", "meta": ' + json.dumps(_nested(150, {})).encode() + b"}",
         "/admin/executions"),
        (b'{"engine_id": "e1", "url": "ftp://x"}', "/admin/engines"),
        (b'{"engine_id": "e1", "url": "http://[::1"}', "/admin/engines"),
        (b'{"engine_id": "e1", "url": "http://h:99999"}', "/admin/engines"),
        (b'{"engine_id": "a b", "url": "http://h:1"}', "/admin/engines"),
        (b'{"engine_id": "e1", "url": "http://h\\u00e9:1"}', "/admin/engines"),
        (b"\xff", "/admin/executions"),
    ]  # fmt: skip
    for raw, path in bad:
        r = _admin_raw(proxy, "POST", path, raw)
        check_shape("openai", r, 400, "invalid_request_error")
    assert "a" not in proxy.call(lambda: proxy.app.service.executions)
    assert proxy.call(proxy.app.routes)["engines"] == ["e0"]
    admin(url, "/admin/executions", {"execution_id": "adm"}, token=token)
    for status in ("", "open", "x" * 300, 5):
        r = _admin_raw(
            proxy, "POST", "/admin/executions/adm/close", json.dumps({"status": status}).encode()
        )
        check_shape("openai", r, 400, "invalid_request_error")
    assert not proxy.call(lambda: proxy.app.service.execution("adm").closed)
    r = _admin_raw(proxy, "GET", "/metrics", b"", accept="text/plain; version=1.x")
    assert r.status_code == 200 and "gyre_proxy_requests" in r.text  # the classic text format
