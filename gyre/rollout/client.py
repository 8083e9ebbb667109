"""`EngineClient`: async client of one rollout engine over SGLang's native HTTP protocol.

The proxy and the coordinator drive engines only through this class, and it sends only
SGLang fields, so the same code drives the embedded CPU engine and real SGLang servers
(the one exception, `request_log`, reads the embedded engine's debugging route). Every
failure (connection refused, timeout, HTTP error, malformed body) raises `EngineError`
carrying the engine id, the route and the server's message; an aborted generation is not
an error: it returns a `GenerateResult` with ``finish_type == "abort"``.

    client = EngineClient("http://127.0.0.1:30000", engine_id="e0")
    result = await client.generate(ids, SamplingParams(max_new_tokens=64), rid="x-1")

**Connections.** Plain-HTTP engines are called over keep-alive HTTP/1.1 connections that
the client pools (Tornado's simple client opened a new TCP connection, resolving the host on
a worker thread, for every call: ~2.5 ms of proxy CPU per model call in
`tools/bench_proxy.py overhead`). The pool holds non-blocking sockets, not event-loop
transports, so one client may be used from several event loops in turn (as tests do with
`asyncio.run`). At most `max_connections` calls per event loop are in flight at once
(more wait, as with Tornado's `max_clients`). `https://` engines go through Tornado's
client, one connection per call. A pooled connection is reused only while idle for less
than `keepalive_s` (below the 5 s idle timeout of uvicorn, SGLang's server) and only if the
server has not closed it (checked with a non-blocking peek just before use). Request bodies
are encoded with orjson: a /generate body carries the whole context's token ids, which
`json.dumps` encodes at ~0.15 µs per token (~5 ms for a 32k-token context, on the IOLoop
that serves every harness); orjson is ~6x faster.

**Resending rule.** A request that fails on a *reused* connection before any byte of the
response arrived is sent once more on a fresh connection when the server cannot have acted
on it: the request was not completely written (not all of its bytes reached the kernel; a
server handles a request only once it has all of it), or the method is idempotent (GET,
HEAD, DELETE). A POST (e.g. /generate) that
was completely written is never resent, since the server may have received it: that failure
is an `EngineError` (the proxy's router retries it as a failed engine call). A failure on a
fresh connection is always an `EngineError`. A timed-out or cancelled call closes its
connection, so the engine sees the client leave (the embedded engine aborts the call).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import socket
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
import orjson
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gyre.errors import EngineError, ProtocolError
from gyre.rollout.protocol import GenerateResult, SamplingParams

if TYPE_CHECKING:
    import torch

# Many concurrent calls per engine (one per live harness): raise Tornado's default of 10.
AsyncHTTPClient.configure(None, max_clients=1024)

IDEMPOTENT = frozenset({"GET", "HEAD", "DELETE"})  # safe to resend after a stale connection
MAX_HEAD_BYTES = 64 * 1024  # status line + headers of a response
RECV_BYTES = 256 * 1024


class EngineClient:
    """One engine's routes as async methods."""

    def __init__(
        self,
        base_url: str,
        *,
        engine_id: str | None = None,
        timeout: float = 3600.0,
        connect_timeout: float = 10.0,
        keepalive_s: float = 2.0,
        max_connections: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_id = engine_id or self.base_url
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        url = urlsplit(self.base_url)
        self._http = _Origin(url.hostname or "", url.port or 80, url.netloc, url.path)
        self._pool = _Pool(keepalive_s) if url.scheme == "http" else None
        if self._pool is not None:  # a dropped client closes its idle sockets (no leak warning)
            weakref.finalize(self, self._pool.close)
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def close(self) -> None:
        """Close the idle pooled connections; calls in flight close theirs when done."""
        if self._pool is not None:
            self._pool.close()

    async def generate(
        self, input_ids: Sequence[int] | np.ndarray, sampling: SamplingParams, rid: str
    ) -> GenerateResult:
        """One /generate call with behaviour log-probs.

        `input_ids` may be a numpy integer array: it is encoded straight into the body
        (5x faster than a list for long contexts: 1.4 vs 7 ms for 100k tokens)."""
        ids: Any = input_ids
        if isinstance(ids, np.ndarray):
            ids = np.ascontiguousarray(ids)
        elif not isinstance(ids, list):
            ids = list(ids)
        body = {
            "input_ids": ids,
            "sampling_params": sampling.to_json(),
            "return_logprob": True,
            "rid": rid,
        }
        reply = await self._call("POST", "/generate", body)
        try:
            return GenerateResult.from_response(reply)
        except ProtocolError as e:
            raise EngineError(f"engine {self.engine_id}: {e}") from e

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: str = "retract") -> None:
        """Hold generation at a step boundary; in-flight calls wait ("retract"/"in_place")
        or end as aborted ("abort")."""
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", {})

    async def health(self) -> bool:
        """True if the engine answers /health with 200 (never raises)."""
        try:
            await self._call("GET", "/health", None, timeout=5.0)
        except EngineError:
            return False
        return True

    async def weight_version(self) -> str:
        return str((await self._call("GET", "/get_weight_version", None))["weight_version"])

    async def model_info(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/get_model_info", None))

    async def release_memory(self) -> None:
        await self._call("POST", "/release_memory_occupation", {})

    async def resume_memory(self) -> None:
        await self._call("POST", "/resume_memory_occupation", {})

    async def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str | None = None
    ) -> None:
        """Load named CPU tensors (embedded engine's torch_save wire format) and set version."""
        from gyre.rollout.weights import encode_named_tensors

        body = {
            "serialized_named_tensors": [encode_named_tensors(named_tensors)],
            "load_format": "torch_save",
            "flush_cache": True,
            "weight_version": version,
        }
        await self._call("POST", "/update_weights_from_tensor", body)

    async def request_log(self) -> list[dict[str, Any]]:
        """Embedded engine only: the /generate calls it received, oldest first
        (each {"rid", "input_ids", "t"})."""
        return list((await self._call("GET", "/gyre/requests", None))["requests"])

    async def clear_request_log(self) -> None:
        """Embedded engine only: forget the received-request log."""
        await self._call("DELETE", "/gyre/requests", None)

    async def stats(self) -> dict[str, Any]:
        """Embedded engine only: queue lengths and decode steps by batch size."""
        return dict(await self._call("GET", "/gyre/stats", None))

    # -- transport --------------------------------------------------------------------------

    async def _call(
        self, method: str, route: str, body: Any, *, timeout: float | None = None
    ) -> Any:
        """Send one request; the decoded JSON reply, or EngineError naming engine and route."""
        payload = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        if self._pool is None:
            status, text = await self._fetch_tornado(method, route, payload, timeout)
        else:
            status, text = await self._fetch_pooled(method, route, payload, timeout)
        if not 200 <= status < 300:
            raise EngineError(f"engine {self.engine_id} {route}: HTTP {status}: {text}")
        if not text.strip():
            return {}
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
        try:  # Python's json also reads NaN / Infinity
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}

    async def _fetch_pooled(
        self, method: str, route: str, payload: bytes | None, timeout: float | None
    ) -> tuple[int, str]:
        """(status, body text or error message) over a pooled keep-alive connection."""
        limit = timeout or self.timeout
        where = f"engine {self.engine_id} {route}"
        try:
            async with self._slot(), asyncio.timeout(limit):
                status, reason, body = await self._exchange(method, route, payload)
        except TimeoutError:
            raise EngineError(f"{where}: HTTP 599: Timeout after {limit:g} s") from None
        except _ConnectFailed as e:
            raise EngineError(f"{where}: cannot connect: {e.__cause__}") from None
        except _Lost as e:
            raise EngineError(f"{where}: {e}") from None
        text = body.decode(errors="replace")
        if 200 <= status < 300:
            return status, text
        return status, _error_text(body) or reason

    def _slot(self) -> asyncio.Semaphore:
        """This event loop's bound on concurrent connections to the engine."""
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.max_connections)
        return slots

    async def _exchange(
        self, method: str, route: str, payload: bytes | None
    ) -> tuple[int, str, bytes]:
        """One request/response, on a pooled connection if one is live, resent once on a
        fresh connection if the pooled one turns out stale (see the module's rule)."""
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        request = self._http.request(method, route, payload)
        conn = self._pool.take()
        if conn is not None:
            try:
                return await self._roundtrip(loop, conn, method, request, reused=True)
            except _Resendable:
                pass
        try:
            conn = await self._http.connect(loop, self.connect_timeout)
        except OSError as e:
            raise _ConnectFailed() from e
        return await self._roundtrip(loop, conn, method, request, reused=False)

    async def _roundtrip(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: _Connection,
        method: str,
        request: bytes,
        *,
        reused: bool,
    ) -> tuple[int, str, bytes]:
        assert self._pool is not None
        written = False
        conn.received = 0
        try:
            await loop.sock_sendall(conn.sock, request)
            written = True
            status, reason, body, keep = await _read_response(loop, conn, method)
        except (OSError, _Closed, _Malformed) as e:
            conn.close()
            if reused and conn.received == 0 and (not written or method in IDEMPOTENT):
                raise _Resendable() from e
            raise _Lost(_lost_message(e, written, conn.received)) from e
        except BaseException:  # timeout, cancellation: the server must see us leave
            conn.close()
            raise
        if keep and not conn.buf:
            self._pool.put(conn)
        else:
            conn.close()
        return status, reason, body

    async def _fetch_tornado(
        self, method: str, route: str, payload: bytes | None, timeout: float | None
    ) -> tuple[int, str]:
        """(status, body text or error message) with Tornado's client (https engines)."""
        request = HTTPRequest(
            self.base_url + route,
            method=method,
            body=payload,
            headers={"Content-Type": "application/json"},
            request_timeout=timeout or self.timeout,
            connect_timeout=self.connect_timeout,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as e:
            body = e.response.body if e.response is not None else b""
            return e.code, _error_text(body or b"") or str(e.message)
        except OSError as e:
            raise EngineError(f"engine {self.engine_id} {route}: cannot connect: {e}") from None
        return response.code, response.body.decode() if response.body else ""


def _error_text(body: bytes) -> str:
    """An error reply's message: SGLang's {"message": ...}, else the body's start."""
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]


def _lost_message(e: BaseException, written: bool, received: int) -> str:
    if isinstance(e, _Malformed):
        return f"malformed response: {e}"
    if received:
        return f"connection broke in the middle of the response ({e!r})"
    if written:
        return (
            f"connection closed before any response ({e!r}); the engine may have received "
            "the request, so it was not resent"
        )
    return f"connection failed while sending the request ({e!r})"


class _Resendable(Exception):
    """A stale pooled connection failed before the server can have acted on the request."""


class _ConnectFailed(Exception):
    """No TCP connection to the engine (the cause holds the OSError)."""


class _Lost(Exception):
    """The connection failed during the exchange; the message says at which point."""


class _Malformed(Exception):
    """The server's bytes are not an HTTP/1.x response."""


class _Closed(Exception):
    """The server closed the connection (EOF) while a response was expected."""


class _Origin:
    """Where a plain-HTTP engine listens, and how its requests start."""

    def __init__(self, host: str, port: int, netloc: str, path: str) -> None:
        self.host, self.port, self.path = host, port, path.rstrip("/")
        self._head = f"Host: {netloc}\r\nUser-Agent: gyre\r\nAccept-Encoding: identity\r\n"

    def request(self, method: str, route: str, payload: bytes | None) -> bytes:
        """The request's bytes: HTTP/1.1 head (keep-alive is the default) and body."""
        head = f"{method} {self.path}{route} HTTP/1.1\r\n{self._head}"
        if payload is None:
            return (head + "\r\n").encode("latin-1")
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        return head.encode("latin-1") + payload

    async def connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> _Connection:
        """A new TCP connection (TCP_NODELAY); OSError if none of the addresses answers."""
        try:
            async with asyncio.timeout(timeout):
                return await self._connect(loop)
        except TimeoutError:
            raise OSError(f"timed out after {timeout:g} s connecting to {self.host}") from None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        last: OSError = OSError(f"no address for {self.host!r}")
        for family, address in await self._addresses(loop):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, address)
            except OSError as e:
                sock.close()
                last = e
                continue
            except BaseException:
                sock.close()
                raise
            return _Connection(sock)
        raise last

    async def _addresses(self, loop: asyncio.AbstractEventLoop) -> list[tuple[int, Any]]:
        """IP literals directly; host names through the resolver (a worker thread)."""
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            return [(family, address) for family, _, _, _, address in infos]
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        return [(family, (self.host, self.port))]


class _Connection:
    """One TCP connection to the engine: a non-blocking socket and the bytes read ahead."""

    __slots__ = ("buf", "idle_since", "received", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.idle_since = 0.0
        self.received = 0  # response bytes of the current exchange

    def close(self) -> None:
        self.sock.close()

    def usable(self) -> bool:
        """An idle connection may carry a request: the server has neither closed it nor
        sent anything unasked (a non-blocking peek finds nothing to read)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # EOF, or bytes nobody asked for

    async def fill(self, loop: asyncio.AbstractEventLoop) -> None:
        data = await loop.sock_recv(self.sock, RECV_BYTES)
        if not data:
            raise _Closed("the server closed the connection")
        self.received += len(data)
        self.buf += data

    async def read_until(self, loop: asyncio.AbstractEventLoop, sep: bytes, limit: int) -> bytes:
        """Bytes up to and including `sep` (`_Malformed` past `limit` bytes)."""
        start = 0
        while (end := self.buf.find(sep, start)) < 0:
            if len(self.buf) > limit:
                raise _Malformed(f"response line or header longer than {limit} bytes")
            start = max(0, len(self.buf) - len(sep) + 1)
            await self.fill(loop)
        end += len(sep)
        out = bytes(self.buf[:end])
        del self.buf[:end]
        return out

    async def read_exactly(self, loop: asyncio.AbstractEventLoop, n: int) -> bytes:
        while len(self.buf) < n:
            await self.fill(loop)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_to_eof(self, loop: asyncio.AbstractEventLoop) -> bytes:
        try:
            while True:
                await self.fill(loop)
        except _Closed:
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out


class _Pool:
    """Idle keep-alive connections of one client, most recently used first."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.idle: collections.deque[_Connection] = collections.deque()
        self.closed = False

    def take(self) -> _Connection | None:
        """A live idle connection, or None (stale ones are closed on the way)."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since < self.keepalive_s and conn.usable():
                return conn
            conn.close()
        return None

    def put(self, conn: _Connection) -> None:
        """Keep a connection whose last response was read completely."""
        if self.closed:
            conn.close()
            return
        now = conn.idle_since = time.monotonic()
        while self.idle and now - self.idle[0].idle_since >= self.keepalive_s:
            self.idle.popleft().close()
        self.idle.append(conn)

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().close()


async def _read_response(
    loop: asyncio.AbstractEventLoop, conn: _Connection, method: str
) -> tuple[int, str, bytes, bool]:
    """(status, reason, body, keep-alive) of one HTTP/1.x response."""
    while True:
        head = await conn.read_until(loop, b"\r\n\r\n", MAX_HEAD_BYTES)
        version, status, reason, headers = _parse_head(head)
        if not 100 <= status < 200:
            break  # 1xx: informational, the real response follows
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = version == "HTTP/1.1" and "close" not in tokens
    if method == "HEAD" or status in (204, 304):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(loop, conn)
    elif "content-length" in headers:
        body = await conn.read_exactly(loop, _length(headers["content-length"]))
    else:  # delimited by the end of the connection
        body, keep = await conn.read_to_eof(loop), False
    return status, reason, body, keep


def _parse_head(head: bytes) -> tuple[str, int, str, dict[str, str]]:
    """(version, status, reason, headers with lower-case names) of a response head."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise _Malformed(f"bad status line {lines[0][:100]!r}")
    headers: dict[str, str] = {}
    name = ""
    for line in lines[1:]:
        if not line:
            continue
        if line[0] in " \t" and name:  # obsolete line folding: continues the last field
            headers[name] += " " + line.strip()
            continue
        field, sep, value = line.partition(":")
        if not sep:
            raise _Malformed(f"bad header line {line[:100]!r}")
        name, value = field.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return version, int(code), reason, headers


def _length(value: str) -> int:
    if not value.isdigit():
        raise _Malformed(f"bad Content-Length {value[:100]!r}")
    return int(value)


async def _read_chunked(loop: asyncio.AbstractEventLoop, conn: _Connection) -> bytes:
    """A chunked body (chunk extensions and trailers are read and ignored)."""
    parts: list[bytes] = []
    while True:
        line = await conn.read_until(loop, b"\r\n", MAX_HEAD_BYTES)
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise _Malformed(f"bad chunk size {size_text[:100]!r}") from None
        if size == 0:
            while await conn.read_until(loop, b"\r\n", MAX_HEAD_BYTES) != b"\r\n":
                pass  # trailer fields
            return b"".join(parts)
        parts.append(await conn.read_exactly(loop, size))
        if await conn.read_exactly(loop, 2) != b"\r\n":
            raise _Malformed("chunk not followed by CRLF")
