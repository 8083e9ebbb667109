"""Engines forked from a process that has already imported what they need.

An embedded engine started as a new interpreter spends most of its start importing torch and
transformers (~6 of its ~9 CPU-seconds here), which the cell rank that starts it has already
imported. So an engine-hosting rank forks one *zygote* early, before it starts threads of
its own (a fork of a threaded process inherits locks other threads hold): a single-threaded
process that holds what an engine imports (`preload`) and then only forks, one child per
engine the rank asks for. The child becomes the engine as
``python -m MODULE ARGS`` would (`runpy`), with the environment, working directory and output
it was given.

    zygote.start(preload)                       # the rank, before it starts threads
    zygote.on_demand("gyre.rollout.server:preload")  # or a new process at the first engine
                                                  # (a process with threads: a test worker)
    ...
    if zygote.forks(argv):                      # [sys.executable, "-m", module, ...]
        proc = zygote.launch(argv, env=env, stdout=PIPE, stderr=log.fileno(), name="gyre-engine-3")
    proc.pid, proc.poll(), proc.wait(timeout), proc.stdout   # as a subprocess.Popen's

Lifetimes stay as `gyre.lifetime` promises: the zygote gets SIGKILL when its rank dies, each
engine when the zygote dies, so an engine still dies with the rank that asked for it. Each
engine runs in its own session (the rank stops it with `killpg`, as a Popen'd one); the zygote
reaps it and reports its exit status to the rank. An engine is named `name` (its
`/proc/PID/comm`, what `ps` and `top` show): its command line and `/proc/PID/environ` are
still the rank's, the memory a fork starts from.

Rank and zygote talk over a `SOCK_SEQPACKET` socket pair: a request is one JSON message with
the child's standard output and error as file descriptors (`SCM_RIGHTS`), answered by its
pid; an exit is one message, sent whenever a child ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

PIPE = subprocess.PIPE
_MAX_MESSAGE = 1 << 20
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


class Forked:
    """One child of the zygote, seen from the rank: what `EngineProcess` uses of a Popen."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str], stdout: IO[bytes] | None):
        self.zygote, self.pid, self.args, self.stdout = zygote, pid, args, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = self.zygote.exit_status(self.pid, timeout=min(left or 1.0, 1.0))
        return code


class Zygote:
    """The rank's end of its zygote: launch requests, and the exits the zygote reports."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.alive = True
        self.lock = threading.Lock()

    def launch(
        self, argv: list[str], *, env: dict[str, str], stdout: int, stderr: int, name: str
    ) -> Forked:
        """Fork ``argv`` (``python -m MODULE ARGS``) from the zygote. `stdout` and `stderr`
        are file descriptors, or `PIPE` for stdout (read from the returned `stdout`)."""
        read_end = None
        if stdout == PIPE:
            read_end, stdout = os.pipe()
        request = {"module": argv[2], "argv": argv[3:], "env": env, "cwd": os.getcwd(),
                   "name": name}  # fmt: skip
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [stdout, stderr])
                pid = self._answer()
        except BaseException:
            if read_end is not None:
                os.close(read_end)
            raise
        finally:
            if read_end is not None:
                os.close(stdout)  # the child holds the write end
        self.children.add(pid)
        return Forked(self, pid, argv, os.fdopen(read_end, "rb") if read_end is not None else None)

    def exit_status(self, pid: int, timeout: float) -> int | None:
        """`pid`'s exit status (negative: the signal that killed it), waiting up to `timeout`
        seconds for it; None while it runs."""
        with self.lock:
            self._receive(timeout)
            return self.exits.get(pid)

    def _answer(self) -> int:
        """The pid the zygote answers a launch with (exits that arrive first are kept)."""
        while True:
            message = self._message(None)
            if message is None:
                raise OSError(f"engine zygote (pid {self.pid}) is gone")
            if "pid" in message:
                return int(message["pid"])

    def _receive(self, timeout: float) -> None:
        """Take the exits the zygote has reported (waiting up to `timeout` for the first)."""
        while self._message(timeout) is not None:
            timeout = 0.0

    def _message(self, timeout: float | None) -> dict[str, Any] | None:
        if not self.alive:
            return None
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:  # the zygote died: its children got SIGKILL with it (PDEATHSIG)
            self.alive = False
            for pid in self.children - self.exits.keys():
                self.exits[pid] = -signal.SIGKILL
            return None
        message: dict[str, Any] = json.loads(data)
        if "exit" in message:
            global _reaped_cpu_s
            self.exits[int(message["exit"])] = int(message["status"])
            _reaped_cpu_s += float(message["cpu_s"])
        return message


_zygote: Zygote | None = None
_on_demand: str | None = None  # the preload of a zygote to spawn at the first engine
_spawning = threading.Lock()
_reaped_cpu_s = 0.0  # CPU seconds of the children reported ended, until their zygote is reaped


def reaped_cpu_s() -> float:
    """CPU seconds of this process's zygote's children that ended so far: what
    `resource.getrusage(RUSAGE_CHILDREN)` will count only once the zygote is reaped."""
    return _reaped_cpu_s


def start(preload: Callable[[], None]) -> Zygote:
    """Import what engines need (`preload`), then fork this process's zygote. Call it in
    the main thread before it starts other threads."""
    global _zygote
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        ours.close()
        _serve(theirs, parent)  # never returns
    theirs.close()
    _zygote = Zygote(pid, ours)
    return _zygote


def spawn(preload: str) -> Zygote:
    """Start this process's zygote as a new interpreter that imports `preload`
    (``module:function``) and serves as a forked one does: for a process that already runs
    threads (a test worker), which must not fork itself. It costs one more import of what
    engines need, repaid from the second engine on."""
    global _zygote
    from gyre.lifetime import die_with_parent

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
        argv = [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid()), preload]
        pid = subprocess.Popen(die_with_parent(argv), pass_fds=[theirs.fileno()]).pid
    _zygote = Zygote(pid, ours)
    return _zygote


def close(timeout: float = 10.0) -> None:
    """End this process's zygote, if it has one: its children still running are killed,
    and the zygote reaped (so its children's CPU time is this process's children's, as a
    Popen'd engine's is)."""
    global _zygote, _reaped_cpu_s, _on_demand
    z, _zygote, _on_demand = _zygote, None, None
    if z is None:
        return
    z.sock.close()  # the zygote reads the end: it kills and reaps its children, then exits
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):  # reaped already (subprocess's own cleanup)
        while os.waitpid(z.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(z.pid, signal.SIGKILL)
                os.waitpid(z.pid, 0)
                break
            time.sleep(0.01)
    _reaped_cpu_s = 0.0  # in this process's RUSAGE_CHILDREN now, with the zygote's own


def on_demand(preload: str) -> None:
    """Spawn this process's zygote (`spawn(preload)`) when it first starts an engine."""
    global _on_demand
    _on_demand = preload


def forks(argv: list[str]) -> bool:
    """Whether this process has a zygote alive (or `on_demand`, spawned now) that can start
    `argv` (``python -m ...``)."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return False
    with _spawning:
        if _zygote is None and _on_demand is not None:
            spawn(_on_demand)
    return _zygote is not None and _zygote.alive


def launch(argv: list[str], *, env: dict[str, str], stdout: int, stderr: int, name: str) -> Forked:
    """`Zygote.launch` on this process's zygote (`forks(argv)` first)."""
    assert _zygote is not None, "zygote.start first"
    return _zygote.launch(argv, env=env, stdout=stdout, stderr=stderr, name=name)


def _serve(sock: socket.socket, parent: int) -> None:
    """The zygote: fork a child per request, report each child's exit, until the rank goes."""
    try:
        os.setsid()  # the rank's group signals (a terminal's ^C) reach the rank, not here
        _die_with_parent(parent)
        _set_name("gyre-zygote")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        running: set[int] = set()
        while True:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
            _report_exits(sock, running)
            if sock.fileno() in ready:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
                if not data:
                    break  # the rank closed its end
                pid = _fork_child(json.loads(data), fds, sock, (wake_r, wake_w))
                running.add(pid)
                sock.send(json.dumps({"pid": pid}).encode())
        for pid in running:  # the rank is leaving: nothing of it stays
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(0)


def _report_exits(sock: socket.socket, running: set[int]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        running.discard(pid)
        message = {"exit": pid, "status": os.waitstatus_to_exitcode(status),
                   "cpu_s": usage.ru_utime + usage.ru_stime}  # fmt: skip
        with contextlib.suppress(OSError):
            sock.send(json.dumps(message).encode())


def _fork_child(request: dict[str, Any], fds: list[int], sock: socket.socket,
                wake: tuple[int, int]) -> int:  # fmt: skip
    """Fork the child of `request`; returns its pid once it runs in its own session."""
    ready_r, ready_w = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _become(request, fds, [sock.fileno(), *wake], ready_w, zygote)  # never returns
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF once the child has its session (or has died)
    os.close(ready_r)
    for fd in fds:
        os.close(fd)
    return pid


def _become(request: dict[str, Any], fds: list[int], close: list[int], ready: int,
            zygote: int) -> None:  # fmt: skip
    """In the child: ``python -m module argv`` with the request's session, output,
    environment and name."""
    code: int = 1
    try:
        os.setsid()
        _die_with_parent(zygote)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(ready)
        for fd in close:
            os.close(fd)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the rank's: MPI's, its sockets, logs
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _set_name(request["name"])
        sys.argv = [request["module"], *request["argv"]]
        code = _run_module(request["module"])
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_module(module: str) -> int:
    """Run `module` as ``python -m`` would; its exit status."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _main(fd: str, parent: str, preload: str) -> None:
    """`spawn`'s zygote: import `preload`'s, then serve the socket `fd` until `parent` goes."""
    import importlib

    module, function = preload.split(":")
    getattr(importlib.import_module(module), function)()
    sys.stdout.flush()
    sys.stderr.flush()
    _serve(socket.socket(fileno=int(fd)), int(parent))


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (and now, if it already has)."""
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _set_name(name: str) -> None:
    """This process's name in `/proc/PID/comm` (15 bytes at most)."""
    _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


if __name__ == "__main__":
    _main(*sys.argv[1:4])
