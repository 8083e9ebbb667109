"""`HttpTransport`: JSON over keep-alive HTTP to one engine, on aiohttp.

`EngineClient` (the protocol: SGLang's routes) sends every request through this class; it
owns connections, timeouts and the mapping of transport failures to `EngineError`s that
name the engine and the route. aiohttp pools keep-alive connections per event loop
(`aiohttp.ClientSession` + `TCPConnector`), so the transport keeps one session per loop
that uses it (the proxy has one; tests that call `asyncio.run` repeatedly get a fresh one
each time, and the sessions of closed loops are dropped).

    transport = HttpTransport("http://127.0.0.1:30000", engine_id="e0", timeout=3600)
    status, body = await transport.request("POST", "/generate", payload_bytes)

**Resending rule** (aiohttp's, RFC 9112 §9.3.1): a request that fails on a *reused*
connection because the server closed it is sent once more on a fresh connection only if
its method is idempotent (GET, HEAD, DELETE, ...). A POST (e.g. /generate) is never resent,
since the server may have received it: that failure is an `EngineError` (the proxy's router
retries it as a failed engine call). Connections the server closed while idle are noticed
by the event loop and never reused. A timed-out or cancelled call closes its connection, so
the engine sees the client leave (the embedded engine aborts the call). At most
`max_connections` calls per event loop are in flight at once; more wait for a connection.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import aiohttp

from gyre.errors import EngineError
from gyre.rollout.protocol import auth_headers

JSON_HEADERS = {"Content-Type": "application/json", "User-Agent": "gyre"}


class HttpTransport:
    """Requests to one engine's base URL over pooled keep-alive connections."""

    def __init__(
        self,
        base_url: str,
        *,
        engine_id: str,
        timeout: float,
        connect_timeout: float = 10.0,
        keepalive_s: float = 2.0,
        max_connections: int = 1024,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.auth = auth_headers(api_key)
        self.engine_id = engine_id
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s  # below uvicorn's (SGLang's server) 5 s idle timeout
        self.max_connections = max_connections
        self._budget = self._timeout(timeout)
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        weakref.finalize(self, _close_all, self._sessions)  # a dropped transport leaks nothing

    async def request(
        self, method: str, route: str, payload: bytes | None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of one request; EngineError when no response arrived."""
        limit = timeout or self.timeout
        budget = self._budget if timeout is None else self._timeout(timeout)
        headers = {**(JSON_HEADERS if payload is not None else {}), **self.auth}
        try:
            async with self._session().request(
                method, self.base_url + route, data=payload, headers=headers, timeout=budget
            ) as response:
                return response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            where = f"engine {self.engine_id} {route}"
            raise EngineError(f"{where}: {_failure(e, method, limit)}") from None

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=self.connect_timeout)

    def close(self) -> None:
        """Close the idle connections of every session; later calls open new ones."""
        _close_all(self._sessions)

    def _session(self) -> aiohttp.ClientSession:
        """This event loop's session (created on first use; closed loops' are dropped)."""
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for old in [lp for lp in self._sessions if lp.is_closed()]:
                _close_quietly(old, self._sessions.pop(old))
            connector = aiohttp.TCPConnector(
                limit=self.max_connections,
                keepalive_timeout=self.keepalive_s,
                enable_cleanup_closed=False,
            )
            session = self._sessions[loop] = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies: skip the jar
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return session


def _close_all(sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession]) -> None:
    while sessions:
        loop, session = sessions.popitem()
        _close_quietly(loop, session)


def _close_quietly(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> None:
    """Close a session from synchronous code. Its connector closes the sockets at once;
    on a running loop the rest of aiohttp's close runs as a task, on a stopped one it is run
    to the end, and a closed loop has nothing left to run (the connector is only marked)."""
    connector = session.connector
    session.detach()
    if connector is None:
        return
    if loop.is_closed():
        connector._close()  # the public close() would schedule on the dead loop
        return
    waiter = connector.close()
    if loop.is_running():
        task = asyncio.ensure_future(_await(waiter), loop=loop)
        _closing.add(task)
        task.add_done_callback(_closing.discard)
    else:
        loop.run_until_complete(_await(waiter))


_closing: set[asyncio.Future[None]] = set()  # close tasks in flight (the loop holds weak refs)


async def _await(waiter: Any) -> None:
    await waiter


def _failure(e: BaseException, method: str, limit: float) -> str:
    """What went wrong, in the words of the module's rules."""
    if isinstance(e, TimeoutError):
        return f"HTTP 599: Timeout after {limit:g} s"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect: {e.os_error or e}"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return _lost(method, e)
    if isinstance(e, aiohttp.ClientPayloadError):
        return f"connection broke in the middle of the response ({e})"
    if isinstance(e, aiohttp.ClientResponseError):  # not an HTTP/1.x response
        return f"malformed response: {e.message}"
    return f"{type(e).__name__}: {e}"


def _lost(method: str, e: Exception) -> str:
    if method in ("GET", "HEAD", "DELETE", "PUT", "OPTIONS"):
        return f"connection closed before any response ({e!r}), also when resent once"
    return (
        f"connection closed before any response ({e!r}); the engine may have received "
        "the request, so it was not resent"
    )
