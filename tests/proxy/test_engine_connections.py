"""The proxy's pooled engine connections are invisible to harnesses.

The proxy keeps keep-alive connections to its engines (`EngineClient`). A harness must
never see an error because one of them went stale: here an engine server closes idle
connections after 0.2 s (a real Tornado server with a short `idle_connection_timeout`),
and an engine is restarted on a new port and re-added under the same engine id.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import tornado.httpserver
import tornado.netutil
import tornado.web
from conftest import MODEL, engine_requests

from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.rollout.testing import running_engine

EOS = 2  # <|im_end|> in the tiny tokenizer


class IdleClosingEngine:
    """A /generate server (two-token answers) that closes connections idle for 0.2 s."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.closed = 0  # connections the server has closed or lost
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> IdleClosingEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._server.stop()
            await self._server.close_all_connections()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> None:
        engine = self

        class Generate(tornado.web.RequestHandler):
            def post(self) -> None:
                body = json.loads(self.request.body)
                engine.rids.append(body["rid"])
                meta = {
                    "id": body["rid"],
                    "finish_reason": {"type": "stop", "matched": EOS},
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": 2,
                    "weight_version": "0",
                    "output_token_logprobs": [[-1.0, 300, None], [-0.5, EOS, None]],
                }
                self.write({"text": "ok", "output_ids": [300, EOS], "meta_info": meta})

        class CountingServer(tornado.httpserver.HTTPServer):
            def on_close(self, server_conn: Any) -> None:
                engine.closed += 1
                super().on_close(server_conn)

        app = tornado.web.Application([("/generate", Generate)])
        self._server = CountingServer(app, idle_connection_timeout=0.2)
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        self._server.add_sockets(sockets)
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"


def _wait_until(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    messages.append({"role": "user", "content": "and then?"})
    return reply


@pytest.fixture
def config() -> Config:
    return Config(model_names=[MODEL], reroute_wait_s=5.0)


def test_engine_closing_idle_connections_is_invisible(tokenizer: Any, config: Config) -> None:
    with (
        IdleClosingEngine() as engine,
        running_proxy({"e0": engine.url}, tokenizer=tokenizer, config=config) as p,
    ):
        key = p.call(p.app.register_execution, "idle", "main")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        for turn in range(3):
            closed = engine.closed
            _ask(client, messages)
            _wait_until(lambda c=closed: engine.closed > c, f"the engine closed turn {turn}'s")
        tree = p.call(p.app.tree, "idle")
        assert [n.attempts for n in tree.nodes] == [1, 1, 1]  # no call failed, none retried
        assert len(engine.rids) == len(set(engine.rids)) == 3


def _add_engine(proxy_url: str, token: str, engine_id: str, url: str) -> None:
    body = json.dumps({"engine_id": engine_id, "url": url}).encode()
    req = urllib.request.Request(
        proxy_url + "/admin/engines",
        data=body,
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


@pytest.fixture
def proxy_without_engines(tokenizer: Any, config: Config) -> Iterator[Any]:
    with running_proxy({}, tokenizer=tokenizer, config=config) as p:
        yield p


def test_engine_restarted_on_a_new_port_is_invisible(proxy_without_engines: Any) -> None:
    p = proxy_without_engines
    key = p.call(p.app.register_execution, "restart", "main")
    client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    with running_engine("tiny") as first:
        _add_engine(p.url, p.admin_token, "e0", first)
        _ask(client, messages)
        _ask(client, messages)  # on the pooled connection
    with running_engine("tiny") as second:  # the same engine id, another process and port
        _add_engine(p.url, p.admin_token, "e0", second)
        _ask(client, messages)
        tree = p.call(p.app.tree, "restart")
        assert [(n.engine_id, n.attempts) for n in tree.nodes] == [("e0", 1)] * 3
        assert [n.parent_id for n in tree.nodes] == [0, 1, 2]  # still one conversation
        received = [r for r in engine_requests(second) if r.startswith("restart-")]
        assert len(received) == 1 and received[0].startswith("restart-3-")  # sent once
