"""A cell's rollout engine as a child process of the cell rank.

The engine (`engine.backend`: the embedded engine, `python -m gyre.rollout.cli`, or an SGLang
server; both launched from the `gyre.rollout.sglang.config` presets, with the run's engine
key) runs in its own process so that it can be
killed (SIGKILL, OOM) without taking the MPI world down: the cell notices the exit, reports
the loss, and restarts it on request. The cell talks to it over the SGLang HTTP protocol
with blocking calls (the cell rank has no event loop), making the same control procedures
as `EngineClient` (`gyre.rollout.protocol`): release (pause in mode "abort", then
`release_memory_occupation`) and resume (`resume_memory_occupation`, then
`continue_generation`) on role switches, and `gyre.rollout.weights.publish_procedure` to
publish. Failures are urllib's (`OSError`s: refused, reset, timed out, HTTP errors).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from gyre.errors import EngineError
from gyre.lifetime import die_with_parent
from gyre.rollout.protocol import (
    Procedure,
    auth_headers,
    engine_key,
    release_procedure,
    resume_procedure,
)
from gyre.rollout.sglang.config import SERVER_ENV
from gyre.rollout.sglang.process import free_port
from gyre.runtime.config import EngineConfig


class EngineProcess:
    """Starts, watches, drives and stops one embedded engine process."""

    def __init__(
        self,
        model: str,
        config: EngineConfig,
        log_path: Path,
        version: int,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.model, self.config, self.log_path = model, config, log_path
        self.labels = labels or {}  # extra environment: lets operators and tests find it
        self.version = version
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.released = False

    def command(self) -> tuple[list[str], str]:
        """The argv that starts this engine, and its URL ("" when the engine picks its port
        and prints the URL: the embedded engine)."""
        server = self.config.server(self.model, self.version)
        if self.config.backend == "embedded":
            return server.command(0), ""
        port = free_port(server.host)
        return server.command(port), f"http://{server.host}:{port}"

    def spawn(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for its URL and /health)."""
        cmd, url = self.command()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(self.config.threads),
               **SERVER_ENV, **self.labels}  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as err:  # the engine dies with its cell rank
            # the embedded engine's first stdout line is its URL; SGLang's output is its log
            out = subprocess.PIPE if not url else err
            self.proc = subprocess.Popen(die_with_parent(cmd), stdout=out, stderr=err, env=env)
        self.url, self.released = url, False

    def wait_ready(self, timeout: float) -> str:
        """Block until the engine prints its URL and answers /health; returns the URL."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.url and time.monotonic() < deadline:
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline().decode()
                if "listening on " in line:
                    self.url = line.strip().rsplit(" ", 1)[-1]
            if self.proc.poll() is not None:
                raise EngineError(f"engine exited with {self.proc.returncode}: {self._tail()}")
        while self.url and time.monotonic() < deadline:
            try:
                self.call("GET", "/health", timeout=2)
                return self.url
            except OSError:
                time.sleep(0.1)
        raise EngineError(f"engine did not start within {timeout:.0f}s: {self._tail()}")

    def dead(self) -> int | None:
        """The exit status if the process ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def call(self, method: str, path: str, body: Any = None, timeout: float = 120) -> Any:
        return http(self.url, method, path, body, timeout)

    def release(self) -> None:
        """Abort every outstanding call and drop KV caches and weights (ROLLOUT -> TRAIN)."""
        run_procedure(self.url, release_procedure())
        self.released = True

    def resume(self) -> None:
        """Restore the weights the engine had and let it generate again (TRAIN -> ROLLOUT)."""
        run_procedure(self.url, resume_procedure())
        self.released = False

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish weights of `version` into the engine."""
        push_weights(self.url, named, version)
        self.version = version

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


def http(url: str, method: str, path: str, body: Any = None, timeout: float = 120) -> Any:
    """One blocking JSON call to an engine route."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **auth_headers(engine_key())}
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def run_procedure(url: str, procedure: Procedure, timeout: float = 120) -> None:
    """Make a procedure's calls, then its cleanup calls (always); raise the first error."""
    error: Exception | None = None
    for call in procedure.calls:
        try:
            http(url, "POST", call.route, call.body, timeout)
        except Exception as e:
            error = e
            break
    for call in procedure.cleanup:
        try:
            http(url, "POST", call.route, call.body, timeout)
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


def push_weights(url: str, named: list[tuple[str, torch.Tensor]], version: int) -> None:
    """Publish `named` as `version` on the engine at `url` (`publish_procedure`)."""
    from gyre.rollout.weights import publish_procedure

    run_procedure(url, publish_procedure(named, str(version)), timeout=600)
