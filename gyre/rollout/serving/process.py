"""Start, health-check and stop one rollout server process (SGLang or the embedded engine).

    proc = EngineProcess(ServerConfig(model_path="tiny", launch="embedded"), log_path=path)
    url = proc.start()          # blocks until GET /health answers 200
    ...
    proc.stop()                 # SIGTERM to the server's process group, SIGKILL after grace

Every engine Gyre starts is one of these: a cell's (`gyre.runtime.cell.engine_host.EngineHost`
builds on it), a test's (`gyre.rollout.testing.running_engine`) and the GPU checks'. `start`
is `spawn` (returns at once) and `wait_ready` (blocks), so a caller can start an engine and
do other work while it loads.

The embedded engine, launched on port 0, binds a port the OS picks and prints ``... listening
on URL`` as its first stdout line, which `wait_ready` reads; any other server gets a free
port on its command line. An engine-hosting rank forks the embedded engine on the CPU from
its zygote (`gyre.zygote`: no second import of torch and transformers); any
other server is a new process — on a GPU node too: a CUDA-aware MPI may have created a CUDA
context before the zygote was forked, and CUDA does not survive a fork. The server runs in its own session (process group), so SGLang's
scheduler and detokenizer children stop with it, and gets SIGKILL when the process that
started it dies (`gyre.lifetime.die_with_parent`). Its environment is this process's, the
config's `env`, and `config.SERVER_ENV` (SGLANG_RETURN_ORIGINAL_LOGPROB=1: behaviour
log-probs before temperature). Its output goes to `log_path` (appended: a restarted engine
keeps its earlier log) or a temporary file; the tail is included in the `EngineError` when
it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

from gyre import zygote
from gyre.errors import EngineError
from gyre.lifetime import die_with_parent
from gyre.rollout.serving.config import SERVER_ENV, ServerConfig

EMBEDDED = ("embedded", "embedded-cuda")
"""The launches of Gyre's own engine (`gyre.rollout.cli`, `gyre.gpu.engine`)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free now (bind to 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """One server process and its URL ("" until known)."""

    def __init__(self, config: ServerConfig, *, log_path: str | Path | None = None) -> None:
        self.config = config
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: subprocess.Popen[bytes] | zygote.Forked | None = None
        self.url = ""
        self._log: IO[bytes] | None = None
        self._started = 0.0
        self._stopped = False  # this process's group was signalled and reaped
        self.startup_seconds: float | None = None

    def command(self) -> tuple[list[str], str]:
        """The argv that starts this server, and its URL ("" when the server picks its port
        and prints the URL: the embedded engine on port 0)."""
        if self.config.launch in EMBEDDED and self.config.port == 0:
            return self.config.command(0), ""
        port = self.config.port or free_port(self.config.host)
        return self.config.command(port), f"http://{self.config.host}:{port}"

    def start(self) -> str:
        """Launch the server and wait until `/health` answers; returns the base URL. A server
        that does not come up is stopped."""
        self.spawn()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def spawn(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for its URL and /health)."""
        if self.alive():
            raise EngineError(f"server {self.url}: already started")
        self.stop()  # an earlier process that ended: its group and its log
        cmd, url = self.command()
        self._log = self._open_log()  # closed in stop()
        env = {**os.environ, **self.config.env, **SERVER_ENV}
        self._started, self.startup_seconds = time.monotonic(), None
        self._stopped = False
        stdout = subprocess.PIPE if not url else self._log  # the URL line, or the log
        if self.config.launch == "embedded" and zygote.forks(cmd):  # the CPU engine only
            out = stdout if stdout == subprocess.PIPE else self._log.fileno()
            self.proc = zygote.launch(cmd, env=env, stdout=out, stderr=self._log.fileno(),
                                      name=self.process_name())  # fmt: skip
        else:
            self.proc = subprocess.Popen(
                die_with_parent(cmd), stdout=stdout, stderr=self._log, env=env,
                start_new_session=True,
            )  # fmt: skip
        self.url = url

    def process_name(self) -> str:
        """What `ps` shows for an engine forked by the zygote: ``gyre-engine-<id>``, the id
        its cell gave it (`GYRE_ENGINE_INDEX` in its environment) where it has one."""
        index = self.config.env.get("GYRE_ENGINE_INDEX")
        return "gyre-engine" + (f"-{index}" if index is not None else "")

    def wait_ready(self, timeout: float | None = None) -> str:
        """Block until the server has a URL and answers /health (within `timeout` seconds,
        default the config's `startup_timeout`); returns the URL."""
        assert self.proc is not None, "spawn first"
        limit = self.config.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self.url and time.monotonic() < deadline:
            self._read_url()
        while self.url and time.monotonic() < deadline:
            self._check_running()
            if _healthy(self.url):
                self.startup_seconds = time.monotonic() - self._started
                return self.url
            time.sleep(0.1)
        raise EngineError(
            f"server {self.url or '(no URL yet)'} did not answer /health within {limit:.0f} s: "
            f"{self.log_tail()}"
        )

    def _read_url(self) -> None:
        """Read the server's stdout for ``listening on URL`` (for up to 0.2 s)."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
        if ready:
            line = self.proc.stdout.readline().decode()
            if "listening on " in line:
                self.url = line.strip().rsplit(" ", 1)[-1]
        self._check_running()

    def _check_running(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise EngineError(
                f"server {self.url or '(no URL yet)'} exited with {self.proc.returncode} before "
                f"/health: {self.log_tail()}"
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def dead(self) -> int | None:
        """The exit status if the process ended (also after `stop`), else None."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output (of its log file, once stopped)."""
        if self._log is None:
            try:
                return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
            except OSError:
                return "(no log)"
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - chars))
        return self._log.read().decode(errors="replace")

    def stop(self, grace: float = 15.0) -> int | None:
        """Terminate the server's process group; returns its exit code (None: never started).
        `dead()` reports the code from now on; `spawn` starts the server again."""
        if self.proc is None:
            return None
        if not self._stopped:
            self._stopped = True
            _stop_group(self.proc, grace)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def _open_log(self) -> IO[bytes]:
        if self.log_path is None:
            return tempfile.TemporaryFile()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.log_path, "a+b")


def _healthy(url: str) -> bool:
    """Whether GET /health answers 200 (the route is open: no engine key)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _stop_group(proc: subprocess.Popen[bytes] | zygote.Forked, grace: float) -> None:
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    else:  # the leader is gone; its children may not be
        _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes] | zygote.Forked, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the group this Popen created (start_new_session)
