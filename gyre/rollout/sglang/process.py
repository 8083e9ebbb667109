"""Start, health-check and stop one rollout server process (SGLang or the embedded engine).

    proc = EngineProcess(ServerConfig(model_path="tiny", launch="embedded"), log_path=path)
    url = proc.start()          # blocks until GET /health answers 200
    ...
    proc.stop()                 # SIGTERM to the server's process group, SIGKILL after grace

The server runs in its own session (process group), so SGLang's scheduler and detokenizer
children stop with it. Its environment is this process's, the config's `env`, and
`config.SERVER_ENV` (SGLANG_RETURN_ORIGINAL_LOGPROB=1: behaviour log-probs before
temperature). Its stdout and stderr go to `log_path` (or a temporary file); the tail
is included in the `EngineError` when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

from gyre.errors import EngineError
from gyre.rollout.sglang.config import SERVER_ENV, ServerConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free now (bind to 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """One server process and its URL."""

    def __init__(self, config: ServerConfig, *, log_path: str | Path | None = None) -> None:
        self.config = config
        self.log_path = Path(log_path) if log_path is not None else None
        self.port = config.port
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> str:
        """Launch the server and wait until `/health` answers; returns the base URL."""
        if self.proc is not None:
            raise EngineError(f"server {self.url}: already started")
        self.port = self.config.port or free_port(self.config.host)
        cmd = self.config.command(self.port)
        self._log = (  # closed in stop()
            open(self.log_path, "wb")  # noqa: SIM115
            if self.log_path is not None
            else tempfile.TemporaryFile()  # noqa: SIM115
        )
        env = {**os.environ, **self.config.env, **SERVER_ENV}
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_healthy(t0 + self.config.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self.url

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(
                    f"server {self.url} exited with {self.proc.returncode} before /health: "
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise EngineError(
            f"server {self.url} did not answer /health within "
            f"{self.config.startup_timeout:.0f} s: {self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - chars))
        return self._log.read().decode(errors="replace")

    def stop(self, grace: float = 15.0) -> int | None:
        """Terminate the server's process group; returns its exit code."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            code = _stop_group(proc, grace)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> int:
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    else:  # the leader is gone; its children may not be
        _signal_group(proc, signal.SIGKILL)
    return int(proc.returncode)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the group this Popen created (start_new_session)
