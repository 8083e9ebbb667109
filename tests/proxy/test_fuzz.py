"""Fuzz the running proxy: >= 10,000 generated and mutated requests, 0 5xx, 0 changed trees.

A real Tornado proxy on loopback, in front of the real embedded tiny engine and journaling
to an HDF5 trace, gets valid requests of all three model APIs and of the admin routes,
mutated by hypothesis: deleted, extra and retyped keys, random JSON, lone UTF-16 surrogates
(values and keys), NaN / Infinity, huge and overflowing numbers, deep nesting, broken JSON
bytes (cut, invalid UTF-8, bad escapes, non-JSON number literals), bad / foreign / closed
keys, odd headers, wrong methods and paths. One keep-alive connection carries them all.

Every answer must be < 500 and, when it refuses, in its API's own error shape. Trees are
recorded before the fuzz (open ones whose keys the fuzz keeps using, and closed ones); after
it, each tree's digest over its nodes from before is unchanged in memory and in the trace
file (closed trees and the journal), and the trees grew by exactly one node per 200 answer.

Most mutations are refused before the engine (the embedded engine takes ~20-40 ms a call on
two shared cores, the proxy ~1 ms a refusal); the test prints how many reached it.
`GYRE_FUZZ_REQUESTS` changes the count (default 10,000).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, TOOLS, anthropic_tools, engine_requests, tree_digest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, running_proxy
from gyre.trajectory.reader import TraceReader
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import trees_equal

N_REQUESTS = int(os.environ.get("GYRE_FUZZ_REQUESTS", "10000"))
LIVE = "live-engine-7c1f9"  # the engine id the fuzz never names (so it never drains it)
APIS = ("openai", "anthropic", "responses")
PATHS = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}

# -- valid requests ------------------------------------------------------------------------------

CALL_ARGS = '{"path": "src", "all": false}'
OA_TOOLS_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You list files."},
    {"role": "user", "content": "ls src"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_h1",
                "type": "function",
                "function": {"name": "ls", "arguments": CALL_ARGS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_h1", "content": "a.py\nb.py"},
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS] + [
    {"type": "namespace", "name": "fs", "tools": [{"type": "function", **TOOLS[1]["function"]}]},
    {"type": "web_search"},
]


def bases() -> dict[str, list[dict[str, Any]]]:
    """Valid bodies per API (the fuzz mutates copies of them)."""
    return {
        "openai": [
            {"model": MODEL, "max_tokens": 1, "tools": TOOLS, "messages": OA_TOOLS_CHAT,
             "temperature": 0.7, "top_p": 0.9},
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "auto",
             "max_completion_tokens": 1},
            {"model": MODEL, "max_tokens": 1, "tools": TOOLS, "messages": OA_TOOLS_CHAT[:2],
             "tool_choice": {"type": "function", "function": {"name": "read"}}},
        ],
        "anthropic": [
            {"model": MODEL, "max_tokens": 1, "tools": anthropic_tools(),
             "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
             "messages": [
                 {"role": "user", "content": "ls src"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "hm", "signature": "x"},
                     {"type": "tool_use", "id": "toolu_h1", "name": "ls",
                      "input": {"path": "src", "all": False}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "toolu_h1",
                      "content": [{"type": "text", "text": "a.py"}]},
                     {"type": "text", "text": "and now?"}]},
             ]},
            {"model": MODEL, "max_tokens": 1, "stream": True, "temperature": 0.5,
             "metadata": {"user_id": "{\"session\": 1}"}, "thinking": {"type": "disabled"},
             "messages": [{"role": "user", "content": [
                 {"type": "text", "text": "look"},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
            {"model": MODEL, "max_tokens": 1, "tools": anthropic_tools(), "tool_choice": {"type": "any"},
             "messages": [{"role": "user", "content": "read it"}]},
        ],
        "responses": [
            {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 1, "store": False,
             "tools": RESPONSES_TOOLS, "tool_choice": "auto",
             "input": [
                 {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
                 {"type": "reasoning", "summary": []},
                 {"type": "function_call", "call_id": "call_r1", "name": "ls", "arguments": CALL_ARGS},
                 {"type": "function_call_output", "call_id": "call_r1", "output": "a.py"},
             ]},
            {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 1, "temperature": 1},
            {"model": MODEL, "input": "go", "tools": RESPONSES_TOOLS, "tool_choice": "required",
             "max_output_tokens": 1},
        ],
    }  # fmt: skip


# -- the generator -------------------------------------------------------------------------------
# Strategies are built once, at import: a strategy made inside a draw is validated anew each
# time, which costs more than the request it generates. `pick` draws an index instead.

IDX = st.integers(0, 2**16 - 1)
SURROGATES = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2
)
TEXT = st.text(max_size=6) | SURROGATES
ODD: st.SearchStrategy[Any] = st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), 10**30, -(10**30), 2**64, 10**4000, 1e308,
     -1e308, 5e-324, -0.0, 0, -1, 1.5, True, False, None, "", [], {}]
)  # fmt: skip
LEAF = st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats() | TEXT | ODD
JSON = LEAF | st.lists(LEAF, max_size=3) | st.dictionaries(TEXT, LEAF, max_size=2)
LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400", b"1" * 5000, b"0x10",
            b"01", b"1.", b"+1", b".5", b"1e", b"tru", b"nul", b"'a'", b"[1,]", b"{1:2}"]  # fmt: skip
IN_STRING = [b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"\x00", b"\x1f", b"\\x41",
             b"\\u12", b"\\ud800\\u0041", b"\\udc00\\ud800", b"\\", b'\\"']  # fmt: skip
DEEP = [98, 101, 150, 1100]  # levels: within the limit (100), beyond it, beyond the parser's
DEEP_INNER = [b"0", b"{}", b'{"type": "object"}']
OPS = ("delete", "replace", "retype", "odd", "surrogate", "wrap", "stringify", "deep", "extra",
       "literal", "badstring", "retype", "odd", "delete")  # fmt: skip
EDITS = st.integers(1, 3)
BATCH = 5  # requests per hypothesis example (its fixed cost per example is ~1 ms)
_DELETE = object()


def pick(draw: Any, seq: Any) -> Any:
    """An element of `seq` (the index scrambled: hypothesis favours small integers)."""
    return seq[(draw(IDX) * 2654435761) % len(seq)]  # a prime: coprime to every length


def _slots(body: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a JSON value: the places an edit can go."""
    out: list[tuple[Any, Any]] = []
    stack = [body]
    while stack:
        node = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node))
        for k in keys:
            out.append((node, k))
            if isinstance(node[k], (dict, list)):
                stack.append(node[k])
    return out


def _retyped(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool):
        return "true"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return {"0": value[0]} if value else "[]"
    if isinstance(value, dict):
        return list(value.values())
    return 0


def mutated(draw: Any, base: Any) -> bytes:
    """`base` with 1-3 edits at random places, as JSON bytes (NaN / Infinity kept)."""
    body = json.loads(json.dumps(base))
    splices: list[bytes] = []  # raw bytes for the markers placed in the body
    for _ in range(draw(EDITS)):
        op = pick(draw, OPS)
        slots = _slots(body)
        if (op == "extra" and draw(IDX) % 4 == 0) or not slots:
            body[draw(TEXT)] = draw(JSON)  # a new top-level key
            continue
        parent, where = pick(draw, slots)
        parent[where] = _edit(draw, op, parent[where], splices)
        if parent[where] is _DELETE:
            del parent[where]
    return serialize(body, splices)


def serialize(body: Any, splices: list[bytes]) -> bytes:
    raw = json.dumps(body).encode()  # allow_nan: NaN / Infinity literals stay in
    for i, piece in enumerate(splices):
        raw = raw.replace(json.dumps(_marker(i)).encode(), piece)
    return raw


def _marker(i: int) -> str:
    return f"\x01splice{i}\x01"


def _splice(splices: list[bytes], piece: bytes) -> str:
    splices.append(piece)
    return _marker(len(splices) - 1)


def _edit(draw: Any, op: str, node: Any, splices: list[bytes]) -> Any:
    if op == "delete":
        return _DELETE
    if op == "retype":
        return _retyped(node)
    if op == "odd":
        return draw(ODD)
    if op == "surrogate":
        if isinstance(node, str):
            cut = draw(IDX) % (len(node) + 1)
            return node[:cut] + draw(SURROGATES) + node[cut:]
        if isinstance(node, dict):
            return {**node, draw(SURROGATES): draw(TEXT)}
        return draw(SURROGATES)
    if op == "wrap":
        return [node]
    if op == "stringify":
        return json.dumps(node)
    if op == "deep":  # spliced as bytes: json.dumps itself cannot nest 1100 deep
        n = pick(draw, DEEP)
        return _splice(splices, b"[" * n + pick(draw, DEEP_INNER) + b"]" * n)
    if op == "extra" and isinstance(node, dict):
        return {**node, draw(TEXT): draw(JSON)}
    if op == "literal":
        return _splice(splices, pick(draw, LITERALS))
    if op == "badstring":
        return _splice(splices, b'"a' + pick(draw, IN_STRING) + b'b"')
    return draw(JSON)


def raw_bytes(draw: Any, base: Any) -> bytes:
    """The base body's bytes, broken: cut, BOM, empty, binary, or a bad piece spliced in."""
    text = json.dumps(base).encode()
    how = pick(draw, ["cut", "bom", "empty", "binary", "splice"])
    if how == "cut":
        return text[: draw(IDX) % (len(text) + 1)] + draw(SHORT_BYTES)
    if how == "bom":
        return b"\xef\xbb\xbf" + text
    if how == "empty":
        return b""
    if how == "binary":
        return draw(BYTES)
    at = draw(IDX) % (len(text) + 1)
    return text[:at] + pick(draw, IN_STRING + LITERALS) + text[at:]


SHORT_BYTES = st.binary(max_size=6)
BYTES = st.binary(max_size=40)


def body_bytes(draw: Any, base: Any, modes: list[str]) -> bytes:
    mode = pick(draw, modes)
    if mode == "mutate":
        return mutated(draw, base)
    if mode == "bytes":
        return raw_bytes(draw, base)
    if mode == "json":
        return json.dumps(draw(JSON)).encode()
    return json.dumps(base).encode()


@dataclass
class Req:
    method: str
    path: str
    headers: dict[str, Any]
    body: bytes | None
    route: str  # openai | anthropic | responses | admin | other
    execution: str | None = None  # whose key it carries (a 200 adds a node there)


@dataclass
class World:
    """What the generator may name: keys, executions, the admin token, the engine URL."""

    proxy: RunningProxy
    engine_url: str
    keys: dict[str, str]  # execution id -> key (fuzz targets, per API)
    targets: dict[str, list[str]]  # api -> execution ids whose keys the fuzz uses
    closed_key: str
    bases: dict[str, list[dict[str, Any]]] = field(default_factory=bases)


KEY_CHOICES = ["good"] * 10 + ["none", "wrong", "closed", "admin", "blank", "bytes", "long",
                               "both", "other"]  # fmt: skip


def key_headers(draw: Any, world: World, api: str, eid: str) -> tuple[dict[str, Any], str | None]:
    """Authentication headers: mostly the target's key, sometimes a bad one, and the
    execution a 200 answer then belongs to (None when the key is refused)."""
    choice = pick(draw, KEY_CHOICES)
    owner: str | None = eid
    if choice == "other":
        owner = pick(draw, sorted(e for e in world.keys if e != eid))
    elif choice != "good":
        owner = None
    value: Any = {
        "good": world.keys[eid], "both": world.keys[eid], "none": None,
        "wrong": "gyre-" + "x" * 32, "closed": world.closed_key,
        "admin": world.proxy.admin_token, "blank": "", "bytes": b"gyre-\xff\xfe\x80",
        "long": "gyre-" + "a" * 6000, "other": world.keys[owner] if owner else None,
    }[choice]  # fmt: skip
    headers: dict[str, Any] = {}
    if value is not None:
        if api == "anthropic" and draw(st.booleans()):
            headers["x-api-key"] = value
        elif isinstance(value, bytes):
            headers["authorization"] = b"Bearer " + value
        else:
            headers["authorization"] = f"Bearer {value}" if value else "Bearer"
    if choice == "both":
        headers["x-api-key"] = "gyre-nope"  # x-api-key wins: a bad one is refused
    return headers, owner


HEADER_NAMES = ["x-gyre-role", "x-gyre-provenance", "anthropic-version", "content-type",
                "accept", "x-stainless-retry-count", "content-encoding"]  # fmt: skip
HEADER_VALUES = ["main", "evaluator", "", "bad role!", "a" * 65, "main\t", "2023-06-01",
                 "application/json", "text/plain", "gzip", b"\xff\xfe", b"\xc3\xa9", "0"]  # fmt: skip


def extra_headers(draw: Any) -> dict[str, Any]:
    return {pick(draw, HEADER_NAMES): pick(draw, HEADER_VALUES) for _ in range(draw(IDX) % 3)}


MODEL_MODES = ["mutate"] * 8 + ["bytes", "bytes", "json", "valid"]
QUERIES = ["", "", "?beta=true", "?a=%ff&b", "?" + "q" * 3000]
METHODS = ["POST"] * 20 + ["GET", "PUT", "DELETE", "PATCH"]


@st.composite
def model_call(draw: Any, world: World) -> Req:
    api = pick(draw, APIS)
    eid = pick(draw, world.targets[api])
    raw = body_bytes(draw, pick(draw, world.bases[api]), MODEL_MODES)
    headers, owner = key_headers(draw, world, api, eid)
    headers.update(extra_headers(draw))
    path, route = PATHS[api], api
    prefix = pick(draw, ["", "", "", "", f"/e/{eid}", "/e/someone-else", "/e/bad%20id"])
    if prefix == "/e/bad%20id":
        route = "other"  # no route matches: 404 in the guessed API's shape
    if prefix and prefix != f"/e/{owner}":
        owner = None
    method = pick(draw, METHODS)
    if method != "POST":
        owner = None
    return Req(method, prefix + path + pick(draw, QUERIES), headers, raw, route, owner)


ADMIN_IDS = [f"adm-{i}" for i in range(12)] + ["", "x" * 200, "a b", "adm-\u00e9"]
SPARES = ["spare-0", "spare-1", "spare-2"]
ADMIN_MODES = ["valid", "mutate", "mutate", "mutate", "bytes", "json"]
ACCEPT = ["text/plain", "application/openmetrics-text; version=1.0.0", "text/plain; version=1.x",
          "application/openmetrics-text; version=abc", "*/*", "application/openmetrics-text",
          "text/plain; version=1.0.0; escaping=zz"]  # fmt: skip


@st.composite
def admin_call(draw: Any, world: World) -> Req:
    eid, spare = pick(draw, ADMIN_IDS), pick(draw, SPARES)
    at = urllib.parse.quote(eid)  # the id in a path
    routes: list[tuple[str, str, Any]] = [
        ("POST", "/admin/executions", {"execution_id": eid, "role": "main", "meta": {"task": "t"}}),
        ("GET", "/admin/executions", None),
        ("GET", f"/admin/executions/{at}", None),
        ("POST", f"/admin/executions/{at}/close", {"status": "completed", "meta": {"r": 1}}),
        ("GET", "/admin/routes", None),
        ("PUT", f"/admin/routes/{at}", {"engine_id": spare}),
        ("POST", "/admin/engines", {"engine_id": spare, "url": world.engine_url}),
        ("POST", f"/admin/engines/{spare}/drain", {"draining": draw(st.booleans())}),
        ("GET", "/metrics", None),
    ]
    method, path, body = pick(draw, routes)
    raw = None if body is None else body_bytes(draw, body, ADMIN_MODES)
    token = pick(draw, [world.proxy.admin_token] * 6 + [None, "wrong-token", b"\xff\xfe"])
    headers: dict[str, Any] = {}
    if token is not None:
        headers["authorization"] = (
            b"Bearer " + token if isinstance(token, bytes) else f"Bearer {token}"
        )
    if path == "/metrics":
        headers["accept"] = pick(draw, ACCEPT)
    if draw(IDX) % 10 == 0:
        method = pick(draw, ["GET", "POST", "PUT", "DELETE", "PATCH"])
    if draw(IDX) % 10 == 0:
        path = path.replace("/admin/", pick(draw, ["/admin//", "/Admin/", "/admin/x/"]))
    return Req(method, path, headers, raw, "admin")


OTHER_PATHS = ["/", "/v1/models", "/e/x/v1/models", "/v1/chat", "/nope", "/v1/messages/count_tokens",
               "/%ff%fe", "/e//v1/messages", "/v1/models?limit=1"]  # fmt: skip


@st.composite
def other_call(draw: Any, world: World) -> Req:
    """The remaining routes: GET/HEAD /, /v1/models, unknown paths."""
    method = pick(draw, ["GET", "HEAD", "POST", "OPTIONS"])
    headers, _ = key_headers(draw, world, "openai", world.targets["openai"][0])
    headers.update(extra_headers(draw))
    body = draw(BYTES) if method == "POST" else None
    return Req(method, pick(draw, OTHER_PATHS), headers, body, "other")


KINDS = ["model"] * 4 + ["admin", "other"]


def requests(world: World) -> st.SearchStrategy[Req]:
    """One request: 4 in 6 to a model API, 1 in 6 admin, 1 in 6 the other routes."""
    kinds = {"model": model_call(world), "admin": admin_call(world), "other": other_call(world)}

    @st.composite
    def request(draw: Any) -> Req:
        return draw(kinds[pick(draw, KINDS)])  # type: ignore[no-any-return]

    return request()


# -- the wire ------------------------------------------------------------------------------------


class Wire:
    """One keep-alive HTTP/1.1 connection (re-opened when the server closes it)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "", parts.port
        self.conn: http.client.HTTPConnection | None = None
        self.reconnects = 0

    def send(self, req: Req) -> tuple[int, dict[str, str], bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            self.reconnects += 1
        try:
            self.conn.putrequest(req.method, req.path, skip_accept_encoding=True)
            for k, v in req.headers.items():
                self.conn.putheader(k, v)
            if req.body is not None:
                self.conn.putheader("Content-Length", str(len(req.body)))
            self.conn.endheaders(req.body)
            r = self.conn.getresponse()
            data = r.read()
        except Exception:
            self.close()
            raise
        if r.getheader("connection", "").lower() == "close" or r.will_close:
            self.close()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def check_shape(req: Req, status: int, headers: dict[str, str], data: bytes) -> None:
    """A refusal is JSON in its API's error shape."""
    if req.method == "HEAD":
        return
    body = json.loads(data)
    anthropic_shape = req.route == "anthropic" or (
        req.route == "other" and "anthropic-version" in req.headers
    )
    if anthropic_shape:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    if status == 413 or req.route == "admin":
        return
    if status in (503, 529):
        assert headers.get("retry-after") == "1"


# -- the test ------------------------------------------------------------------------------------


def _post(w: Wire, path: str, body: Any, key: str) -> bytes:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    status, _, data = w.send(Req("POST", path, headers, json.dumps(body).encode(), "x"))
    assert status == 200, data
    return data


def record_before(p: RunningProxy, w: Wire) -> dict[str, str]:
    """Real calls of every API before the fuzz: open and closed trees. Returns their keys."""
    keys = {}
    for api in APIS:
        for state in ("open", "closed"):
            eid = f"rec-{api}-{state}"
            keys[eid] = key = p.call(p.app.register_execution, eid, "main")
            p.call(p.app.set_route, eid, LIVE)
            for base in bases()[api]:
                _post(w, PATHS[api], base, key)
            if api == "openai":  # a continuation of the recorded reply (a non-root node)
                first: dict[str, Any] = {
                    "model": MODEL,
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "a"}],
                }
                reply = json.loads(_post(w, PATHS[api], first, key))["choices"][0]["message"]
                msgs = [*first["messages"], reply, {"role": "user", "content": "b"}]
                _post(w, PATHS[api], {**first, "messages": msgs}, key)
    for api in APIS:
        p.call(p.app.close_execution, f"rec-{api}-closed", "completed")
    return keys


@pytest.fixture(scope="module")
def fuzz_world(
    engine_url: str, tokenizer: Any, tmp_path_factory: Any
) -> Iterator[tuple[World, Path]]:
    trace = tmp_path_factory.mktemp("fuzz") / "trace.h5"
    config = Config(
        model_names=[MODEL],
        max_body_bytes=64 * 1024,
        max_tokens_cap=1,
        max_context_tokens=4096,
        reroute_wait_s=2.0,
    )
    access = logging.getLogger("tornado.access")
    level = access.level
    access.setLevel(logging.ERROR)  # 10,000 refusals need no access log lines
    writer = TraceWriter(trace, run_meta={"test": "fuzz"})
    try:
        with running_proxy(
            {LIVE: engine_url}, tokenizer=tokenizer, config=config, store=writer
        ) as p:
            w = Wire(p.url)
            keys = record_before(p, w)
            targets: dict[str, list[str]] = {}
            for api in APIS:
                fresh = f"fz-{api}"
                keys[fresh] = p.call(p.app.register_execution, fresh, "main")
                p.call(p.app.set_route, fresh, LIVE)
                targets[api] = [fresh, f"rec-{api}-open"]
            closed_key = keys.pop("rec-openai-closed")
            for api in ("anthropic", "responses"):
                keys.pop(f"rec-{api}-closed")
            w.close()
            yield World(p, engine_url, keys, targets, closed_key), trace
            p.call(p.app.close_store)
    finally:
        access.setLevel(level)


@pytest.mark.slow
def test_fuzzed_requests_never_5xx_and_change_no_tree(fuzz_world: tuple[World, Path]) -> None:
    world, trace = fuzz_world
    p = world.proxy
    before = p.call(
        lambda: {e: (len(x.tree), tree_digest(x.tree)) for e, x in p.app.service.executions.items()}
    )
    closed = {e: p.call(p.app.tree, e) for e in before if e.endswith("-closed")}
    engine_before = len(engine_requests(world.engine_url))
    wire = Wire(p.url)
    statuses: Counter[tuple[str, int]] = Counter()
    accepted: Counter[str] = Counter()
    failures: list[str] = []
    t0 = time.perf_counter()

    @settings(max_examples=-(-N_REQUESTS // BATCH), deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(batch=st.lists(requests(world), min_size=BATCH, max_size=BATCH))
    def some(batch: list[Req]) -> None:
        for req in batch:
            one(req)

    def one(req: Req) -> None:
        status, headers, data = wire.send(req)
        statuses[req.route, status] += 1
        if status >= 500:
            failures.append(
                f"{status} {req.method} {req.path} {req.headers} {req.body!r:.400} -> {data!r:.400}"
            )
        elif status >= 400:
            check_shape(req, status, headers, data)
        elif req.route in APIS and req.method == "POST":
            assert status == 200 and req.execution is not None, (req, data)
            accepted[req.execution] += 1

    some()
    wall = time.perf_counter() - t0
    sent = sum(statuses.values())
    reached = len(engine_requests(world.engine_url)) - engine_before
    after = p.call(lambda: {e: (len(x.tree), tree_digest(x.tree, before[e][0]) if e in before else "")
                            for e, x in p.app.service.executions.items()})  # fmt: skip
    changed = [e for e, (n, digest) in before.items() if after[e][1] != digest]
    print(f"\nfuzz: {sent} requests in {wall:.1f} s; {sum(accepted.values())} accepted (200), "
          f"{reached} reached the engine; 5xx: {len(failures)}; changed trees: {len(changed)} "
          f"of {len(before)}; reconnects: {wire.reconnects}")  # fmt: skip
    print("status counts:", dict(sorted(Counter(s for _, s in statuses.elements()).items())))
    print("by route:", dict(sorted(statuses.items())))
    assert not failures, failures[:5]
    assert sent >= N_REQUESTS
    assert not changed
    for eid, (n, _) in before.items():  # only accepted calls became nodes
        assert after[eid][0] == n + accepted[eid], (eid, n, accepted[eid], after[eid][0])
    for eid in (e for a in APIS for e in world.targets[a] if e not in before):
        assert after[eid][0] == accepted[eid]
    assert 0 < sum(accepted.values()) < sent / 5  # the fuzz reached the engine, mostly did not
    assert reached >= sum(accepted.values())
    # the trace file agrees: closed trees as written, the journal of open ones grew only
    p.call(p.app.flush_store)
    reader = TraceReader(trace)
    try:
        for eid, tree in closed.items():
            assert trees_equal(reader.tree(eid), tree), eid
        journal = reader.recover()
        for eid, (n, digest) in before.items():
            if eid in journal:
                assert tree_digest(journal[eid], n) == digest, eid
                assert len(journal[eid]) == after[eid][0], eid
    finally:
        reader.close()
