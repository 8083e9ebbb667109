"""`EngineClient` keep-alive connections (aiohttp): reuse, stale connections, resending.

Each test runs a real HTTP/1.1 server (`ScriptedEngine`, asyncio streams on its own thread)
that answers /generate and /health like an engine and lets the test decide when it closes
connections: idle ones (as a server's idle timeout does), one right after reading a request
(as a crashing server does), or all of them (a restart on the same port). The server logs
every request it read with the connection it came on, so the tests can check that a
connection was reused and that no /generate was sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from gyre.errors import EngineError
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams

from .conftest import run

SP = SamplingParams(max_new_tokens=2)


@dataclass(frozen=True)
class Seen:
    """One request the server read completely."""

    conn: int  # connection number, in order of acceptance
    method: str
    path: str
    rid: str | None


class ScriptedEngine:
    """A real keep-alive HTTP server speaking just enough of the engine protocol."""

    def __init__(self, port: int = 0, *, chunked: bool = False) -> None:
        self.port = port
        self.chunked = chunked  # answer with Transfer-Encoding: chunked
        self.seen: list[Seen] = []
        self.drop_next = False  # close the connection after reading the next request
        self._ids = itertools.count(1)
        self._idle: set[asyncio.StreamWriter] = set()
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ScriptedEngine:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection, then end the thread (once)."""
        if self._loop.is_closed():
            return

        async def shut() -> None:
            assert self._server is not None
            self._server.close()
            await _close_all(list(self._open))
            await self._server.wait_closed()

        self._call(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def close_idle(self) -> int:
        """Close every connection that waits for its next request (an idle timeout)."""

        async def close() -> int:
            idle = list(self._idle)
            await _close_all(idle)
            return len(idle)

        return self._call(close())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._ids)
        self._open.add(writer)
        self._idle.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self._idle.discard(writer)
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ")
                length = _content_length(head)
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.seen.append(Seen(conn, method, path, body.get("rid")))
                if self.drop_next:
                    self.drop_next = False
                    return
                self._idle.add(writer)  # idle from the client's view once it has the answer
                writer.write(self._response(path, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._idle.discard(writer)
            self._open.discard(writer)
            writer.close()

    def _response(self, path: str, body: dict[str, Any]) -> bytes:
        if path == "/generate":
            meta = {
                "id": body.get("rid"),
                "finish_reason": {"type": "stop", "matched": 2},
                "prompt_tokens": len(body.get("input_ids", [])),
                "completion_tokens": 2,
                "weight_version": "0",
                "output_token_logprobs": [[-1.0, 300, None], [-0.5, 2, None]],
            }
            status, reply = "200 OK", {"text": "ok", "output_ids": [300, 2], "meta_info": meta}
        elif path == "/health":
            status, reply = "200 OK", {"status": "ok"}
        else:
            status, reply = "404 Not Found", {"object": "error", "message": f"no route {path}"}
        data = json.dumps(reply).encode()
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        if not self.chunked:
            return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data
        half = len(data) // 2
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (data[:half], data[half:]))
        return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n"


async def _close_all(writers: list[asyncio.StreamWriter]) -> None:
    """Close connections and wait until their sockets are closed (the peer sees EOF)."""
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def _content_length(head: bytes) -> int:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return int(value)
    return 0


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    server = ScriptedEngine().start()
    try:
        yield server
    finally:
        server.stop()


def _generate(client: EngineClient, rid: str) -> str:
    return run(client.generate([1, 2, 3], SP, rid)).finish_type


def _in_one_loop(*steps: Any) -> list[Any]:
    """Run the steps (sync callables or coroutine functions) in order on one event loop, so
    the client's pooled connection carries over from one to the next."""

    async def main() -> list[Any]:
        out = []
        for step in steps:
            value = step()
            out.append(await value if asyncio.iscoroutine(value) else value)
        return out

    return run(main())


@pytest.mark.parametrize("chunked", [False, True])
def test_calls_reuse_one_connection_per_event_loop(chunked: bool) -> None:
    server = ScriptedEngine(chunked=chunked).start()
    try:
        client = EngineClient(server.url, engine_id="s0")

        async def three() -> list[str]:
            return [(await client.generate([1], SP, f"r{i}")).finish_type for i in range(3)]

        assert run(three()) == ["stop"] * 3
        assert run(client.health())  # a new event loop: its own pooled connection
        assert run(three()) == ["stop"] * 3
        assert [s.conn for s in server.seen] == [1, 1, 1, 2, 3, 3, 3]
        client.close()
    finally:
        server.stop()


def test_connection_closed_by_the_server_while_idle_is_replaced(engine: ScriptedEngine) -> None:
    client = EngineClient(engine.url, engine_id="s0", keepalive_s=3600)

    async def close_idle() -> int:
        closed = await asyncio.to_thread(engine.close_idle)
        await asyncio.sleep(0.05)  # the loop sees the EOF of the idle connection
        return closed

    a, closed, b = _in_one_loop(
        lambda: client.generate([1], SP, "a"), close_idle, lambda: client.generate([1], SP, "b")
    )
    assert (a.finish_type, closed, b.finish_type) == ("stop", 1, "stop")  # b: a fresh one
    assert [(s.conn, s.rid) for s in engine.seen] == [(1, "a"), (2, "b")]


def test_engine_restarted_on_the_same_port(engine: ScriptedEngine) -> None:
    client = EngineClient(engine.url, engine_id="s0", keepalive_s=3600)
    restarted: list[ScriptedEngine] = []

    async def restart() -> None:
        await asyncio.to_thread(engine.stop)
        restarted.append(await asyncio.to_thread(ScriptedEngine(engine.port).start))
        await asyncio.sleep(0.05)

    try:
        before, _, after = _in_one_loop(
            lambda: client.generate([1], SP, "before"),
            restart,
            lambda: client.generate([1], SP, "after"),
        )
        assert (before.finish_type, after.finish_type) == ("stop", "stop")
        assert [s.rid for s in restarted[0].seen] == ["after"]
    finally:
        for server in restarted:
            server.stop()


def test_generate_the_server_may_have_received_is_never_resent(engine: ScriptedEngine) -> None:
    client = EngineClient(engine.url, engine_id="s0", keepalive_s=3600)

    async def dropped() -> str:
        engine.drop_next = True  # reads the request on the pooled connection, then closes it
        try:
            await client.generate([1], SP, "dropped")
        except EngineError as e:
            return str(e)
        return "no error"

    first, error, nxt = _in_one_loop(
        lambda: client.generate([1], SP, "first"), dropped, lambda: client.generate([1], SP, "next")
    )
    assert re.search(r"engine s0 /generate: .*not resent", error), error
    assert [s.rid for s in engine.seen] == ["first", "dropped", "next"]  # each sent once
    assert (first.finish_type, nxt.finish_type) == ("stop", "stop")


def test_idempotent_request_on_a_dropped_connection_is_resent_once(
    engine: ScriptedEngine,
) -> None:
    client = EngineClient(engine.url, engine_id="s0", keepalive_s=3600)

    def drop() -> None:
        engine.drop_next = True

    assert _in_one_loop(client.health, drop, client.health) == [True, None, True]
    assert [(s.conn, s.path) for s in engine.seen] == [
        (1, "/health"),
        (1, "/health"),
        (2, "/health"),
    ]


def test_failures_name_engine_and_route(engine: ScriptedEngine) -> None:
    client = EngineClient(engine.url, engine_id="s0")
    with pytest.raises(EngineError, match=r"engine s0 /model_info: HTTP 404: no route"):
        run(client.weight_version())
    engine.stop()
    gone = EngineClient(engine.url, engine_id="gone", connect_timeout=2)
    with pytest.raises(EngineError, match=r"engine gone /generate: cannot connect"):
        _generate(gone, "x")
    assert run(gone.health()) is False
