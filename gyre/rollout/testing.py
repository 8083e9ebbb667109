"""Test helpers: run an embedded engine in a subprocess for the duration of a `with` block,
and watch the requests a client sends it (`recording_forwarder`).

    with running_engine("tiny") as base_url:
        client = EngineClient(base_url)
        ...

The engine is an `EngineProcess` (the one that starts every engine): it binds a free port
chosen by the OS (``--port 0``), the helper waits for the URL it prints and for /health,
and on exit stops it (SIGTERM, then SIGKILL after a grace period). The engine's output goes
to a temp file whose tail is included in the error if the engine fails to start.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gyre.rollout.protocol import ENGINE_KEY_ENV
from gyre.rollout.serving.config import ServerConfig
from gyre.rollout.serving.process import EngineProcess


@contextmanager
def running_engine(
    model: str = "tiny",
    *,
    threads: int = 1,
    max_batch_size: int = 32,
    weight_version: str = "0",
    prefix_cache_mb: int = 512,
    startup_timeout: float = 120.0,
    extra_args: tuple[str, ...] = (),
    api_key: str | None = None,
) -> Iterator[str]:
    """Start `gyre engine --model MODEL --port 0` and yield its base URL. `api_key`: the
    engine key it takes (default: this process's `GYRE_ENGINE_KEY`, if any)."""
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    if api_key:
        env[ENGINE_KEY_ENV] = api_key
    config = ServerConfig(
        model_path=model, launch="embedded", weight_version=weight_version, env=env,
        startup_timeout=startup_timeout, extra_args=[
            "--threads", str(threads), "--max-batch-size", str(max_batch_size),
            "--prefix-cache-mb", str(prefix_cache_mb), *extra_args,
        ],
    )  # fmt: skip
    engine = EngineProcess(config)
    try:
        yield engine.start()
    finally:
        engine.stop(grace=10)


class _Forward(BaseHTTPRequestHandler):
    """Records (method, route, body bytes); forwards the request to `target` as it came."""

    target: str
    seen: list[tuple[str, str, int]]
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((method, self.path, len(body)))
        headers = {k: v for k, v in self.headers.items() if k.lower() in
                   ("authorization", "content-type")}  # fmt: skip
        req = urllib.request.Request(self.target + self.path, data=body if method == "POST"
                                     else None, headers=headers, method=method)  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status, data = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, data = e.code, e.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def recording_forwarder(target: str) -> Iterator[tuple[str, list[tuple[str, str, int]]]]:
    """A forwarder on the loopback to the engine at `target`: yields (its url, what it saw:
    (method, route, body bytes) of every request, each passed on unchanged) — how a test
    inspects the bodies a movement of weights sends."""
    seen: list[tuple[str, str, int]] = []
    handler = type("Forward", (_Forward,), {"target": target, "seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        thread.join(10)
