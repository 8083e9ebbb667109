"""KV-cache segments that move between embedded engines: pin, pack, read, release.

KV-cache migration on reroute (paper §4.3; the handoff is `gyre.rollout.kvmigrate`) moves
the KV cache of a call's context from the engine it is cancelled on (the *source*) to the
engine it is retried on (the *destination*). A *segment* is the KV of one token sequence,
packed with its token ids into one contiguous host buffer:

    [n token ids, int64][layer 0 keys H*n*D][layer 0 values] ... [layer L-1 values]

* The source *pins* a segment: at a step boundary it copies the KV out of the running
  batch (or its prefix cache) into a buffer nothing else writes or frees, and registers it
  with its Mooncake Transfer Engine when it has one. A pin lives until it is released, until
  its lease (`ttl_s`) runs out, or until the engine releases its memory.
* The destination *reads* it one-sidedly: `transfer_sync_read` of the registered buffer
  over Mooncake (TCP on one machine, RDMA on clusters), or an HTTP GET of
  ``/gyre/kv/segments/HANDLE`` from the source. It unpacks the buffer into per-layer views
  (no copy) and inserts them into its prefix cache, which then serves the retried call.

`KVPort` is one engine's side of it (its pins, its link, its counters); `MooncakeLink` wraps
the one `mooncake.engine.TransferEngine` of an engine process (P2P handshake, no metadata
server; `pip install mooncake-transfer-engine-non-cuda` and Debian `libibverbs1`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gyre.errors import ConfigError, EngineError
from gyre.rollout.prefix import LayerKV
from gyre.rollout.protocol import KVSegment, auth_headers, engine_key

log = logging.getLogger(__name__)
HTTP_CHUNK = 4 << 20  # bytes per write when a segment is served over HTTP
DTYPES = ("float32", "float16", "bfloat16", "float64")  # KV dtypes a segment may hold


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a model's KV cache: what a segment must match to be used."""

    layers: int
    heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of_model(cls, model: Any) -> KVLayout:
        c = model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return cls(int(c.num_hidden_layers), int(heads), int(head_dim), dtype)

    def nbytes(self, tokens: int) -> int:
        if self.dtype not in DTYPES:
            raise EngineError(f"KV dtype {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        size = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 8 * tokens + 2 * self.layers * self.heads * tokens * self.head_dim * size


def pack(tokens: list[int] | np.ndarray, layers: LayerKV) -> np.ndarray:
    """One contiguous buffer holding `tokens` and their per-layer KV ([1, H, n, D] each)."""
    n = len(tokens)
    k0 = layers[0][0]
    layout = KVLayout(len(layers), int(k0.shape[1]), int(k0.shape[3]), _dtype_name(k0.dtype))
    buf = np.empty(layout.nbytes(n), np.uint8)
    buf[: 8 * n].view(np.int64)[:] = tokens
    flat = torch.from_numpy(buf)
    step = (buf.nbytes - 8 * n) // (2 * layout.layers)
    offset = 8 * n
    for pair in layers:
        for t in pair:
            flat[offset : offset + step].view(t.dtype).view(t.shape[1:]).copy_(t[0, :, :n])
            offset += step
    return buf


def unpack(buf: np.ndarray, seg: KVSegment) -> tuple[np.ndarray, LayerKV]:
    """Token ids and per-layer [1, H, n, D] views into `buf` (a packed segment)."""
    layout = KVLayout(seg.layers, seg.heads, seg.head_dim, seg.dtype)
    n = seg.tokens
    if buf.nbytes != layout.nbytes(n):
        raise EngineError(f"KV segment {seg.handle}: {buf.nbytes} B, expected {layout.nbytes(n)}")
    tokens = buf[: 8 * n].view(np.int64)
    flat = torch.from_numpy(buf)
    step = (buf.nbytes - 8 * n) // (2 * seg.layers)
    dtype = getattr(torch, seg.dtype)
    shape = (1, seg.heads, n, seg.head_dim)
    views = [
        flat[8 * n + i * step : 8 * n + (i + 1) * step].view(dtype).view(shape)
        for i in range(2 * seg.layers)
    ]
    return tokens, [(views[2 * i], views[2 * i + 1]) for i in range(seg.layers)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def select(
    found: list[tuple[str, Any, LayerKV]], prefixes: list[str], rids: list[str]
) -> list[tuple[str, str, np.ndarray, LayerKV]]:
    """(selector, rid, tokens, layers) of the `found` (rid, tokens, layers) a selector names
    (an exact rid, else the longest matching rid prefix), leaving out each sequence that
    another one of the same selector extends or repeats (the last of equal ones is kept)."""
    chosen: dict[str, list[tuple[str, np.ndarray, LayerKV]]] = {}
    for rid, tokens, layers in found:
        matches = [p for p in prefixes if rid.startswith(p)]
        sel = rid if rid in rids else max(matches, key=len, default=None)
        if sel is not None:
            chosen.setdefault(sel, []).append((rid, np.asarray(tokens, np.int64), layers))
    out = []
    for sel, items in chosen.items():
        for i, (rid, tokens, layers) in enumerate(items):
            covered = any(
                _extends(other, tokens, later=j > i)
                for j, (_, other, _) in enumerate(items)
                if j != i
            )
            if not covered:
                out.append((sel, rid, tokens, layers))
    return out


def _extends(longer: np.ndarray, shorter: np.ndarray, *, later: bool) -> bool:
    n = len(shorter)
    if len(longer) < n or (len(longer) == n and not later):
        return False
    return bool(np.array_equal(longer[:n], shorter))


# ----- Mooncake Transfer Engine ------------------------------------------------------------


class MooncakeLink:
    """This process's Mooncake Transfer Engine: registers pinned buffers, reads remote ones."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise EngineError(f"mooncake: TransferEngine.initialize({host!r}, {protocol}) failed")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()

    def register(self, buf: np.ndarray) -> None:
        if self.engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
            raise EngineError("mooncake: register_memory failed")

    def unregister(self, buf: np.ndarray) -> None:
        self.engine.unregister_memory(buf.ctypes.data)

    def read(self, session: str, remote_ptr: int, nbytes: int) -> np.ndarray:
        """A copy of `nbytes` at `remote_ptr` in the engine `session` (one-sided read)."""
        local = np.empty(nbytes, np.uint8)
        with self._lock:
            self.register(local)
            try:
                rc = self.engine.transfer_sync_read(session, local.ctypes.data, remote_ptr, nbytes)
            finally:
                self.unregister(local)
        if rc != 0:
            raise EngineError(f"mooncake: transfer_sync_read from {session} returned {rc}")
        return local


def open_link(kind: str, host: str) -> MooncakeLink | None:
    """The Mooncake link for transport `kind`: "http" → None; "mooncake" → a link or
    ConfigError; "auto" → a link if Mooncake is installed and starts, else None (HTTP)."""
    if kind == "http":
        return None
    try:
        return MooncakeLink(host)
    except (ImportError, EngineError) as e:
        if kind == "mooncake":
            raise ConfigError(
                "kv_transport: mooncake needs `pip install mooncake-transfer-engine-non-cuda` "
                f"and Debian libibverbs1 ({e}); or use kv_transport=http"
            ) from None
        log.info("KV migration over HTTP: no Mooncake Transfer Engine (%s)", e)
        return None


# ----- an engine's side of migration: pins (source), receiving (destination) ---------------


@dataclass(slots=True)
class Pin:
    """A pinned segment: its descriptor, its buffer, and when its lease ends."""

    segment: KVSegment
    buffer: np.ndarray
    deadline: float
    registered: bool


Check = Callable[[KVSegment], None]
Insert = Callable[[KVSegment, np.ndarray, LayerKV], None]


class KVPort:
    """One engine's pins by handle (expired leases are dropped on every access), its
    Mooncake link (opened once, by `open_link_early` or on first use) and counters.
    The engine calls `pin` with its step lock held and gives `receive` its own checks."""

    def __init__(self, transport: str, host: str) -> None:
        self.transport, self.host = transport, host
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self._link: MooncakeLink | None = None
        self._link_opened = False
        self._link_lock = threading.Lock()
        self.counts = {"exported": 0, "imported": 0, "import_failures": 0}

    def link(self) -> MooncakeLink | None:
        """The Mooncake link (None: HTTP only), opened on the first call."""
        with self._link_lock:
            if not self._link_opened:
                self._link = open_link(self.transport, self.host)
                self._link_opened = True
            return self._link

    def open_link_early(self) -> None:
        """Open the link now: at once if Mooncake is required (a ConfigError stops the
        engine's start), else in the background (off the first migration's critical path)."""
        if self.transport == "mooncake":
            self.link()
        elif self.transport == "auto":
            threading.Thread(target=self.link, name="gyre-kv-link", daemon=True).start()

    def pin(
        self, selector: str, rid: str, tokens: np.ndarray, layers: LayerKV, *,
        model: str, version: str, ttl_s: float,
    ) -> KVSegment:  # fmt: skip
        """Pack `tokens`' KV into a new pinned buffer (registered with the link if any)."""
        link = self.link()
        buf = pack(tokens, layers)
        k0 = layers[0][0]
        seg = KVSegment(
            handle=secrets.token_hex(8), selector=selector, rid=rid, tokens=len(tokens),
            nbytes=buf.nbytes, layers=len(layers), heads=int(k0.shape[1]),
            head_dim=int(k0.shape[3]), dtype=_dtype_name(k0.dtype), model=model,
            weight_version=version,
        )  # fmt: skip
        if link is not None:
            link.register(buf)
            seg.mooncake_session, seg.mooncake_ptr = link.session, buf.ctypes.data
        with self._lock:
            self._pins[seg.handle] = Pin(seg, buf, time.monotonic() + ttl_s, link is not None)
        return seg

    def buffer(self, handle: str) -> np.ndarray | None:
        """The buffer of a live pin (None if unknown, released or expired)."""
        self.expire()
        with self._lock:
            pin = self._pins.get(handle)
        return None if pin is None else pin.buffer

    def release(self, handles: list[str]) -> int:
        """Drop these pins (unknown handles are ignored); returns how many were live."""
        with self._lock:
            pins = [p for h in handles if (p := self._pins.pop(h, None)) is not None]
        self._unpin(pins)
        return len(pins)

    def expire(self, *, everything: bool = False) -> None:
        """Drop the pins whose lease ran out (all of them: a memory release)."""
        now = time.monotonic()
        with self._lock:
            gone = [h for h, p in self._pins.items() if everything or p.deadline <= now]
            pins = [self._pins.pop(h) for h in gone]
        self._unpin(pins)

    def _unpin(self, pins: list[Pin]) -> None:
        for pin in pins:
            if pin.registered and self._link is not None:
                self._link.unregister(pin.buffer)
        self._count("exported", len(pins))

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def receive(
        self, source: str, segments: list[KVSegment], transport: str, timeout: float, *,
        check: Check, insert: Insert,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
        """Check, read and insert each segment: the destination's acknowledgement,
        (imported, failed). Any failure of one segment only lists it as failed."""
        imported, failed = [], []
        for seg in segments:
            t0 = time.perf_counter()
            try:
                check(seg)
                buf, used = read_segment(seg, source, self.link(), transport, timeout)
                insert(seg, *unpack(buf, seg))
            except Exception as e:  # any failure: the destination recomputes the prefix
                self._count("import_failures")
                failed.append({"handle": seg.handle, "rid": seg.rid, "error": str(e)})
                continue
            self._count("imported")
            imported.append({"handle": seg.handle, "rid": seg.rid, "tokens": seg.tokens,
                             "nbytes": seg.nbytes, "transport": used,
                             "seconds": time.perf_counter() - t0})  # fmt: skip
        return imported, failed

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pinned": len(self._pins),
                "pinned_bytes": sum(p.buffer.nbytes for p in self._pins.values()),
                **self.counts,
            }


# ----- reading (destination side) ---------------------------------------------------------


def read_segment(
    seg: KVSegment, source_url: str, link: MooncakeLink | None, transport: str, timeout: float
) -> tuple[np.ndarray, str]:
    """The packed bytes of `seg`, read from the source; (buffer, transport used)."""
    use_mooncake = transport != "http" and link is not None and seg.mooncake_session is not None
    if transport == "mooncake" and not use_mooncake:
        side = "this engine has no Mooncake link" if link is None else "the source offers none"
        raise EngineError(f"KV segment {seg.handle}: transport mooncake unavailable ({side})")
    if use_mooncake:
        assert link is not None and seg.mooncake_session is not None
        assert seg.mooncake_ptr is not None
        return link.read(seg.mooncake_session, seg.mooncake_ptr, seg.nbytes), "mooncake"
    return _http_read(f"{source_url}/gyre/kv/segments/{seg.handle}", seg.nbytes, timeout), "http"


def _http_read(url: str, nbytes: int, timeout: float) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    view = buf.data  # a writable memoryview of the buffer
    got = 0
    try:
        request = urllib.request.Request(url, headers=auth_headers(engine_key()))
        with urllib.request.urlopen(request, timeout=timeout) as r:
            while got < nbytes:
                n = r.readinto(view[got:])
                if not n:
                    break
                got += n
    except OSError as e:
        raise EngineError(f"GET {url}: {e}") from None
    if got != nbytes:
        raise EngineError(f"GET {url}: {got} of {nbytes} bytes")
    return buf
