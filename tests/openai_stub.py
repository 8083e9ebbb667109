"""Test helper: an OpenAI-compatible `/v1/chat/completions` on loopback that answers from a
script and records what it was sent (a judge endpoint, a scripted judge agent's model).

    with openai_stub(lambda body, n: {"role": "assistant", "content": "{...}"}) as (url, seen):
        ...  # url: the base URL with /v1; seen: [{"body": ..., "auth": ...}] per request

`reply(body, n)` gives the n-th (0-based) answer's message; the server thread is stopped on
exit.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tornado.httpserver
import tornado.netutil
import tornado.web

Reply = Callable[[dict[str, Any], int], dict[str, Any]]


@contextmanager
def openai_stub(reply: Reply) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    class Handler(tornado.web.RequestHandler):
        def post(self) -> None:
            body = json.loads(self.request.body)
            seen.append({"body": body, "auth": self.request.headers.get("Authorization")})
            message = reply(body, len(seen) - 1)
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            self.finish({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "finish_reason": finish, "message": message}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})  # fmt: skip

    ready = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        app = tornado.web.Application([(r"/v1/chat/completions", Handler)])
        server = tornado.httpserver.HTTPServer(app)
        server.add_sockets(sockets)
        state.update(port=sockets[0].getsockname()[1], loop=loop)
        ready.set()
        loop.run_forever()
        server.stop()
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the OpenAI stub did not start")
    try:
        yield f"http://127.0.0.1:{state['port']}/v1", seen
    finally:
        state["loop"].call_soon_threadsafe(state["loop"].stop)
        thread.join(10)
