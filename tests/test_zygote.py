"""An engine zygote forks children that behave as the process a rank would have started.

The rank here is this module run as a program (`python -m tests.test_zygote rank`):
a zygote is forked from a process without threads, as a cell rank forks it, never from a
pytest worker. Its children are this module again (`child`): each reports what it was given.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre import zygote

ROOT = Path(__file__).resolve().parents[1]
CHILD = [sys.executable, "-m", "tests.test_zygote", "child"]


def _rank(log: str, then: str, how: str) -> int:
    """The rank: a zygote (`how`: forked as a cell rank forks it, or a new interpreter as a
    test worker starts it), then three children, reported as JSON lines on stdout; `then`
    "close": it ends its zygote itself, as a rank does before it exits."""
    from gyre import zygote

    os.environ["RANK_ONLY"] = "1"  # the rank's own environment: not its children's
    if how == "fork":
        zygote.start(lambda: None)
    else:
        zygote.spawn("os:getpid")  # a preload that imports nothing
    with open(log, "ab") as err:
        fd = err.fileno()
        env = {"GIVEN": "yes", "PATH": os.environ["PATH"]}
        assert zygote.forks(CHILD)  # python -m MODULE; any other program is a new process
        _say(others=[zygote.forks(["/bin/sleep", "1"]), zygote.forks([sys.executable, "x.py"])])
        told = zygote.launch([*CHILD, "3"], env=env, stdout=zygote.PIPE, stderr=fd, name="gyre-t-1")
        assert told.stdout is not None
        said = json.loads(told.stdout.readline())
        _say(said=said, status=told.wait(timeout=30))
        slow = zygote.launch([*CHILD, "sleep"], env=env, stdout=fd, stderr=fd, name="gyre-t-2")
        while "gyre-t-2" not in Path(log).read_text():  # it runs, and writes to the file
            time.sleep(0.05)
        os.killpg(slow.pid, signal.SIGTERM)  # its own session, as an engine's
        _say(terminated=slow.wait(timeout=30))
        left = zygote.launch([*CHILD, "sleep"], env=env, stdout=fd, stderr=fd, name="gyre-t-3")
        while "gyre-t-3" not in Path(log).read_text():
            time.sleep(0.05)
        _say(child=left.pid, zygote=zygote._zygote.pid if zygote._zygote else 0)
        if then == "close":
            sys.stdin.readline()  # once the test has seen them running
            t = time.monotonic()
            zygote.close()
            _say(closed=time.monotonic() - t < 5)  # its children ended, not waited out
        time.sleep(600)  # the test kills this rank
    return 0


def _child(how: str) -> int:
    """A child: tells what it got, then exits with `how` or sleeps until signalled."""
    comm = Path("/proc/self/comm").read_text().strip()
    if how == "preempted":  # Slurm's SIGUSR1 reaches the process mpiexec started as we start
        signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))
        os.kill(_sharing_stdout(), signal.SIGUSR1)
        how = "sleep"
    if os.environ.get("PMI_FD", "").isdigit():  # a rank: it speaks to mpiexec on this one
        os.write(int(os.environ["PMI_FD"]), f"cmd=hello from {comm}\n".encode())
    _say(given=os.environ.get("GIVEN"), rank_only=os.environ.get("RANK_ONLY"), name=comm,
         session=os.getsid(0) == os.getpid(), argv=sys.argv[1:])  # fmt: skip
    if how == "sleep":
        signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))  # a preempted rank's status
        time.sleep(600)
    return int(how)


def _sharing_stdout() -> int:
    """The other process writing to this one's stdout: the one that entered the zygote."""
    mine = os.readlink("/proc/self/fd/1")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) != os.getpid() and os.readlink(f"/proc/{pid}/fd/1") == mine:
                return int(pid)
        except OSError:
            continue
    raise AssertionError("no other process writes to this one's stdout")


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _start_rank(log: Path, then: str, how: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """The rank, once it checked its first two children: its third child's and zygote's pids."""
    rank = subprocess.Popen(
        [sys.executable, "-m", "tests.test_zygote", "rank", str(log), then, how],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert rank.stdout is not None
        assert json.loads(rank.stdout.readline()) == {"others": [False, False]}
        told = json.loads(rank.stdout.readline())
        assert told["said"] == {"given": "yes", "rank_only": None, "name": "gyre-t-1",
                                "session": True, "argv": ["child", "3"]}  # fmt: skip
        assert told["status"] == 3
        assert json.loads(rank.stdout.readline()) == {"terminated": -signal.SIGTERM}
        pids = json.loads(rank.stdout.readline())
        assert not _gone(pids["child"], 0.2) and not _gone(pids["zygote"], 0.0)
    except BaseException:
        rank.kill()
        rank.wait(timeout=30)
        raise
    return rank, pids


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_zygote_children_get_their_own_world_and_die_with_the_rank(
    tmp_path: Path, how: str
) -> None:
    """A forked engine gets the environment, output, session and name it was launched with
    (not the rank's environment); the rank learns its exit status and the signal that
    stopped it; and when the rank is SIGKILLed, the zygote and every child die with it, as
    an engine started by `setpriv --pdeathsig` does."""
    log = tmp_path / "children.log"
    rank, pids = _start_rank(log, "sleep", how)
    try:
        rank.kill()
        rank.wait(timeout=30)
        assert _gone(pids["zygote"], 10), "the zygote outlived its rank"
        assert _gone(pids["child"], 10), "a child outlived its rank's zygote"
    finally:
        rank.kill()
        rank.wait(timeout=30)
    said = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["name"] for s in said] == ["gyre-t-2", "gyre-t-3"]  # their stdout: the file


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_a_closed_zygote_leaves_nothing_behind(tmp_path: Path, how: str) -> None:
    """A rank that ends its zygote (before it exits) ends the children still running and
    reaps the zygote, at once (a rank does so as it exits): no process, not even a zombie, is
    left, and the children's CPU time is the rank's children's, as a Popen'd engine's is."""
    rank, pids = _start_rank(tmp_path / "children.log", "close", how)
    try:
        assert rank.stdin is not None and rank.stdout is not None
        rank.stdin.write("close\n")
        rank.stdin.flush()
        assert json.loads(rank.stdout.readline()) == {"closed": True}
        assert not Path(f"/proc/{pids['zygote']}").exists(), "the zygote was not reaped"
        assert _gone(pids["child"], 5), "a child outlived its closed zygote"
    finally:
        rank.kill()
        rank.wait(timeout=30)


def _enter(address: str, how: str, rank: int) -> tuple[subprocess.Popen[str], socket.socket]:
    """A rank as mpiexec starts one, through `python -m gyre.zygote`: its PMI socket's other
    end is returned (as mpiexec keeps it)."""
    ours, theirs = socket.socketpair()
    env = {**os.environ, zygote.ENV: address, "PMI_FD": str(theirs.fileno()),
           "PMI_RANK": str(rank), "GIVEN": "yes"}  # fmt: skip
    with theirs:
        proc = subprocess.Popen([sys.executable, "-m", "gyre.zygote", *CHILD[2:], how], cwd=ROOT,
                                env=env, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE,
                                text=True)  # fmt: skip
    return proc, ours


def test_ranks_entered_through_a_rank_zygote_are_its_forks_and_stay_what_mpiexec_sees(
    tmp_path: Path,
) -> None:
    """`gyre run`'s ranks: each process mpiexec starts hands its streams and its PMI socket
    to the rank zygote, which forks the rank from its imports, named for its rank, with that
    process's environment; the process leaves with the rank's exit status, passes its
    signals on (killed by the same one), takes its rank down when it is killed itself, and
    once every rank has entered no one else gets in (a later one runs as a new interpreter)."""
    env = {**os.environ, "ZYGOTE_ONLY": "1"}
    warm = zygote.serve_ranks("os:getpid", ranks=4, env=env)
    procs: list[subprocess.Popen[str]] = []
    try:
        exits, pmi = _enter(warm.address, "3", rank=4)
        procs.append(exits)
        assert exits.stdout is not None
        said = json.loads(exits.stdout.readline())
        assert said == {"given": "yes", "rank_only": None, "name": "gyre-rank-4", "session": True,
                        "argv": ["child", "3"]}  # fmt: skip
        assert pmi.recv(64) == b"cmd=hello from gyre-rank-4\n"  # the PMI socket is the rank's
        assert exits.wait(timeout=30) == 3

        # rank 5 has its entering process sent SIGUSR1 the moment it starts (before that
        # process may know its pid): it is passed on all the same
        sleepers = {rank: _enter(warm.address, how, rank)
                    for rank, how in ((5, "preempted"), (6, "sleep"), (7, "sleep"))}  # fmt: skip
        ranks = {}
        for rank, (proc, _) in sleepers.items():
            procs.append(proc)
            if rank != 5:  # (5 may leave before it says anything)
                assert proc.stdout is not None and json.loads(proc.stdout.readline())
                ranks[rank] = next(int(p) for p in os.listdir("/proc") if p.isdigit() and
                                   _comm(p) == f"gyre-rank-{rank}")  # fmt: skip
        assert sleepers[5][0].wait(timeout=30) == 75  # the rank got it, and said how it left
        sleepers[6][0].send_signal(signal.SIGTERM)
        assert sleepers[6][0].wait(timeout=30) == -signal.SIGTERM  # killed by the same signal
        assert _gone(ranks[6], 10)
        sleepers[7][0].kill()
        sleepers[7][0].wait(timeout=30)
        assert _gone(ranks[7], 10), "a rank outlived the process mpiexec started"

        late, _pmi = _enter(warm.address, "0", rank=8)  # every rank entered: the listener is shut
        procs.append(late)
        assert late.stdout is not None
        assert json.loads(late.stdout.readline())["name"] != "gyre-rank-8"
        assert late.wait(timeout=30) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
        warm.close()
    assert not Path(f"/proc/{warm.pid}").exists() and not Path(warm.address).exists()


def test_an_engine_zygote_forks_from_a_shell_without_thread_settings(tmp_path: Path) -> None:
    """`gyre eval RUN --initial` from a plain shell (no OMP_NUM_THREADS): its engine zygote
    imports what engines import, numpy's OpenBLAS among it, which starts a thread per further
    core as it loads, and a zygote with threads refuses to fork (seen: the evaluation ended in
    a traceback). The zygote imports with one thread; its children still get what they are
    launched with."""
    assert (os.cpu_count() or 1) > 1, "OpenBLAS starts no thread of its own on one core"
    plain = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}  # fmt: skip
    warm = zygote.serve_ranks("gyre.rollout.server:preload", ranks=0, env=plain)
    try:
        with open(tmp_path / "child.log", "wb") as err:
            env = {"GIVEN": "yes", "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
            child = warm.launch([*CHILD, "3"], env=env, stdout=zygote.PIPE, stderr=err.fileno(),
                                name="gyre-t-blas")  # fmt: skip
            assert child.stdout is not None
            assert json.loads(child.stdout.readline())["given"] == "yes"
            assert child.wait(timeout=60) == 3
    finally:
        warm.close()


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


if __name__ == "__main__":
    role = sys.argv[1]
    sys.exit(_rank(*sys.argv[2:5]) if role == "rank" else _child(sys.argv[2]))
