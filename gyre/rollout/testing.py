"""Test helper: run an embedded engine in a subprocess for the duration of a `with` block.

    with running_engine("tiny") as base_url:
        client = EngineClient(base_url)
        ...

The engine binds a free port chosen by the OS (``--port 0``); the helper reads the URL the
engine prints on stdout, waits until /health answers, and on exit terminates the process
(SIGTERM, then SIGKILL after a grace period). The engine's stderr goes to a temp file whose
tail is included in the error if the engine fails to start.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from gyre.errors import EngineError
from gyre.rollout.protocol import ENGINE_KEY_ENV


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
    cmd = [
        sys.executable, "-m", "gyre.rollout.cli", "--model", model, "--host", "127.0.0.1",
        "--port", "0", "--threads", str(threads), "--max-batch-size", str(max_batch_size),
        "--weight-version", weight_version, "--prefix-cache-mb", str(prefix_cache_mb),
        *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    if api_key:
        env[ENGINE_KEY_ENV] = api_key
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env)
        try:
            url = _wait_for_url(proc, stderr, startup_timeout)
            yield url
        finally:
            _stop(proc)


def _wait_for_url(proc: subprocess.Popen[bytes], stderr: IO[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline().decode()
            if "listening on " in line:
                url = line.strip().rsplit(" ", 1)[-1]
                _wait_healthy(url, deadline)
                return url
        if proc.poll() is not None:
            break
    raise EngineError(f"engine did not start (exit {proc.poll()}): {_tail(stderr)}")


def _wait_healthy(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise EngineError(f"engine at {url} never answered /health")


def _tail(stderr: IO[bytes]) -> str:
    stderr.seek(0)
    return stderr.read().decode(errors="replace")[-3000:]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
