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

The ranks of `gyre run` on one machine start the same way, one level up: `gyre run` spawns a
*rank zygote* that imports what every rank imports (`serve_ranks`, before it starts
mpiexec), and mpiexec starts, per rank, ``python -m gyre.zygote MODULE ARGS``
(`enter`): a small process that hands its standard streams and the PMI socket mpiexec gave it
to the zygote over a listening socket, which forks the rank from the warm imports. It stays
what mpiexec sees: it passes its signals on to the rank and leaves as the rank left (its
status, or killed by the same signal); if it is killed, the zygote kills its rank. The
listener lives in a directory only this user can enter and closes once W ranks have
connected — before any harness exists.
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

    def __init__(self, pid: int, sock: socket.socket, address: str = "") -> None:
        self.pid, self.sock, self.address = pid, sock, address
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

    def close(self, timeout: float = 10.0) -> None:
        """End the zygote: its children still running are killed, and the zygote reaped
        (so its children's CPU time is this process's children's, as a Popen'd engine's is)."""
        self.sock.close()  # the zygote reads the end: it kills and reaps its children, exits
        if self.address:
            with contextlib.suppress(OSError):
                os.unlink(self.address)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.address))
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ChildProcessError):  # reaped already (subprocess's cleanup)
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.01)

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
        try:
            data = self.sock.recv(_MAX_MESSAGE)
        except ConnectionResetError:  # it died with our request unread
            data = b""
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


_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
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
    _zygote = _spawn(preload, (), 0, None)
    return _zygote


def serve_ranks(preload: str, *args: str, ranks: int, env: dict[str, str]) -> Zygote:
    """A rank zygote: a new interpreter, with the environment `env` (the ranks'; what it
    imports may read it), that imports `preload` (called with `args`), then forks one child
    for each of the first `ranks` `enter` processes that connect to its `address` (a socket in
    a directory of this user's alone, closed once they have). Not this process's zygote:
    the caller closes it (`Zygote.close`)."""
    return _spawn(preload, args, ranks, env)


def _spawn(preload: str, args: tuple[str, ...], listen: int, env: dict[str, str] | None) -> Zygote:
    from gyre.lifetime import die_with_parent

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds, address, listener = [theirs.fileno()], "", None
    if listen > 0:
        import tempfile

        address = os.path.join(tempfile.mkdtemp(prefix="gyre-zygote-"), "socket")  # 0700
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address)
        listener.listen(listen)
        fds.append(listener.fileno())
    # one thread pool thread while it imports: a BLAS that sizes its pool to the machine (numpy's
    # OpenBLAS on >1 core) starts its threads when loaded, and a zygote forks with one thread;
    # its children set their own (`request["env"]`, `torch.set_num_threads`)
    env = {**(os.environ if env is None else env), **_ONE_THREAD}
    with theirs:
        argv = [sys.executable, "-m", __name__, "--serve", str(os.getpid()),
                str(listener.fileno()) if listener else "-", str(listen), str(theirs.fileno()),
                preload, *args]  # fmt: skip
        pid = subprocess.Popen(die_with_parent(argv), pass_fds=fds, env=env).pid
    if listener is not None:
        listener.close()  # the zygote's now
    return Zygote(pid, ours, address)


def close(timeout: float = 10.0) -> None:
    """End this process's zygote, if it has one (`Zygote.close`)."""
    global _zygote, _reaped_cpu_s, _on_demand
    z, _zygote, _on_demand = _zygote, None, None
    if z is not None:
        z.close(timeout)
        _reaped_cpu_s = 0.0  # in this process's RUSAGE_CHILDREN now, with the zygote's own


def active() -> bool:
    """Whether this process has a zygote, or one to spawn on demand."""
    return _zygote is not None or _on_demand is not None


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


def _serve(sock: socket.socket, parent: int, listener: socket.socket | None = None,
           accept: int = 0, exits: bool = False) -> None:  # fmt: skip
    """The zygote: fork a child per request, report each child's exit to whoever asked for
    it, until the rank goes (`sock`: its end; `listener`: `accept` more, one child each).
    Never returns in the zygote; in a child, it returns only with `exits` (`_Exit`)."""
    conns: dict[int, socket.socket] = {}
    asked: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    try:
        os.setsid()  # the rank's group signals (a terminal's ^C) reach the rank, not here
        _die_with_parent(parent)
        _set_name("gyre-zygote")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        conns[sock.fileno()] = sock
        while True:
            waiting = [*conns, wake_r] + ([listener.fileno()] if listener else [])
            ready, _, _ = select.select(waiting, [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
            _report_exits(asked)
            if listener is not None and listener.fileno() in ready:
                conn, _ = listener.accept()
                conns[conn.fileno()] = conn
                accept -= 1
                if accept <= 0:  # every rank is in: no one else gets to ask
                    listener.close()
                    listener = None
            for fd in [fd for fd in ready if fd in conns]:
                conn = conns[fd]
                try:
                    data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 8)
                except OSError:
                    data = b""
                if data:
                    ours = [sock, *conns.values(), *([listener] if listener else [])]
                    pid = _fork_child(json.loads(data), fds, (wake_r, wake_w), ours, exits)
                    asked[pid] = conn
                    with contextlib.suppress(OSError):  # one gone already: its EOF is next
                        conn.send(json.dumps({"pid": pid}).encode())
                    continue
                if conn is sock:
                    raise _Closed  # the rank closed its end
                del conns[fd]  # an `enter` died: its rank goes with it
                _kill([pid for pid, c in asked.items() if c is conn])
                conn.close()
    except _Closed:
        _kill(list(asked))  # the rank is leaving: nothing of it stays
        for pid in list(asked):
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
    except _Exit:
        raise  # a child of a spawned zygote, leaving as the interpreter it stands for would
    except BaseException:
        traceback.print_exc()
    os._exit(0)


class _Exit(BaseException):
    """A child of a rank zygote (`serve_ranks`) whose program ended: it leaves as a new
    interpreter would (Python's exit handlers, MPI_Finalize among them), from the zygote's
    `_main`. An engine leaves at once, as a rank's fork must (and ~40 s sooner over the
    fast test loop's engines)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Closed(Exception):
    """The zygote's owner closed its end."""


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _report_exits(asked: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = asked.pop(pid, None)
        message = {"exit": pid, "status": os.waitstatus_to_exitcode(status),
                   "cpu_s": usage.ru_utime + usage.ru_stime}  # fmt: skip
        with contextlib.suppress(OSError):
            if conn is not None:
                conn.send(json.dumps(message).encode())


def _fork_child(request: dict[str, Any], fds: list[int], wake: tuple[int, int],
                ours: list[socket.socket], exits: bool) -> int:  # fmt: skip
    """Fork the child of `request`; returns its pid once it runs in its own session. In the
    child, the zygote's sockets (`ours`) are let go of: their numbers become the child's."""
    ready_r, ready_w = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        for own in ours:
            own.detach()
        _become(request, fds, ready_w, zygote, exits)  # returns only by `_Exit`
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF once the child has its session (or has died)
    os.close(ready_r)
    for fd in fds:
        os.close(fd)
    return pid


def _become(request: dict[str, Any], fds: list[int], ready: int, zygote: int,
            exits: bool) -> None:  # fmt: skip
    """In the child: ``python -m module argv`` with the request's session, descriptors
    (`targets`: the numbers `fds` take; standard output and error by default), environment
    and name."""
    import fcntl

    code: int = 1
    try:
        os.setsid()
        _die_with_parent(zygote)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(ready)
        targets: list[int] = request.get("targets", [1, 2])
        above = max([*targets, *fds]) + 1  # out of every target's way first
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd, target in zip(moved, targets, strict=True):
            os.dup2(fd, target)
        keep = sorted({0, 1, 2, *targets})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)  # the zygote's and the rank's: sockets, pipes, logs
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _set_name(request["name"])
        sys.argv = [request["module"], *request["argv"]]
        code = _run_main(request["module"])
    except BaseException:
        traceback.print_exc()
    if exits:
        raise _Exit(code)
    with contextlib.suppress(Exception):  # a fork of a rank: nothing of the rank's may run
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run_main(what: str) -> int:
    """Run `what` as ``python -m what`` would (``python what`` for a ``.py`` file); its exit
    status."""
    try:
        if what.endswith(".py"):
            sys.path[0] = os.path.dirname(os.path.abspath(what))
            runpy.run_path(what, run_name="__main__")
        else:  # as a new interpreter has it: the module only as __main__ (no runpy warning)
            sys.modules.pop(what, None)
            runpy.run_module(what, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    return 0


def imports(*modules: str) -> None:
    """A zygote's preload that imports `modules`."""
    import importlib

    for module in modules:
        importlib.import_module(module)


def _main(parent: str, listener: str, accept: str, fd: str, preload: str, *args: str) -> None:
    """`spawn`'s zygote: import `preload`'s (called with `args`), then serve the socket `fd`
    (and `listener`'s `accept` connections) until `parent` goes."""
    import importlib

    module, function = preload.split(":")
    getattr(importlib.import_module(module), function)(*args)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the forking thread: its locks could stay held
        raise SystemExit(f"zygote: {preload} left {threads} threads; a zygote forks with one")
    sys.stdout.flush()
    sys.stderr.flush()
    server = None if listener == "-" else socket.socket(fileno=int(listener))
    try:
        # ranks and workers leave as new interpreters (MPI_Finalize runs); engines at once
        _serve(socket.socket(fileno=int(fd)), int(parent), server, int(accept),
               exits=server is not None)  # fmt: skip
    except _Exit as child:
        sys.exit(child.code)


ENV = "GYRE_ZYGOTE"
"""The environment variable naming the socket `enter` asks a zygote on."""
ENTERED = "GYRE_ZYGOTE_ENTERED"
"""What `enter` adds to its child's environment: unix seconds it asked (its child is forked
when the zygote has imported what it preloads)."""


_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM)  # fmt: skip
"""The signals `enter` passes on to its child (what mpiexec and Slurm send a rank)."""


def enter(argv: list[str]) -> None:
    """Run ``python -m MODULE ARGS`` (`argv`: MODULE ARGS; or ``python SCRIPT.py ARGS``)
    forked from the zygote `$GYRE_ZYGOTE` names, as this process: its standard streams and PMI socket (`PMI_FD`, which MPICH's
    mpiexec gives a rank) are the child's, its signals are passed on, and it leaves with the
    child's exit status or is killed by the signal that killed the child. Without a zygote
    (none named, gone, or it never answered), this process execs the module itself."""
    address = os.environ.pop(ENV, "")
    name = f"gyre-rank-{os.environ.get('PMI_RANK', '')}"
    fds = [0, 1, 2]
    if os.environ.get("PMI_FD", "").isdigit():
        fds.append(int(os.environ["PMI_FD"]))
    pid = None
    # held until the child's pid is known, then passed on: a signal that comes once the
    # child runs (it may already have written its first line) must reach it, not end this
    # process by the signal's default action before its handler is in place
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _PASSED_ON)
    if address:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, ENTERED: f"{time.time():.3f}"}
        request = {"module": argv[0], "argv": argv[1:], "env": env,
                   "cwd": os.getcwd(), "name": name, "targets": fds}  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            sock.connect(address)
            socket.send_fds(sock, [json.dumps(request).encode()], fds)
            pid = int(json.loads(sock.recv(_MAX_MESSAGE))["pid"])
    if pid is None:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        python = [sys.executable] if argv[0].endswith(".py") else [sys.executable, "-m"]
        os.execv(sys.executable, [*python, *argv])
    for sig in _PASSED_ON:
        signal.signal(sig, lambda signum, _: os.kill(pid, signum))
    signal.pthread_sigmask(signal.SIG_SETMASK, held)  # what came meanwhile is passed on now
    while True:
        data = sock.recv(_MAX_MESSAGE)
        message = json.loads(data) if data else {"status": -signal.SIGKILL}  # zygote gone
        if "status" in message:
            break
    status = int(message["status"])
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status  # a signal whose default is not to end a process
    os._exit(status & 0xFF)


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
    if sys.argv[1:2] == ["--serve"]:
        _main(*sys.argv[2:])
    else:
        enter(sys.argv[1:])
