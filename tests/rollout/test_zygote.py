"""An engine zygote forks children that behave as the process a rank would have started.

The rank here is this module run as a program (`python -m tests.rollout.test_zygote rank`):
a zygote is forked from a process without threads, as a cell rank forks it, never from a
pytest worker. Its children are this module again (`child`): each reports what it was given.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, "-m", "tests.rollout.test_zygote", "child"]


def _rank(log: str, then: str, how: str) -> int:
    """The rank: a zygote (`how`: forked as a cell rank forks it, or a new interpreter as a
    test worker starts it), then three children, reported as JSON lines on stdout; `then`
    "close": it ends its zygote itself, as a rank does before it exits."""
    from gyre.rollout.serving import zygote

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
    _say(given=os.environ.get("GIVEN"), rank_only=os.environ.get("RANK_ONLY"), name=comm,
         session=os.getsid(0) == os.getpid(), argv=sys.argv[1:])  # fmt: skip
    if how == "sleep":
        time.sleep(600)
    return int(how)


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
        [sys.executable, "-m", "tests.rollout.test_zygote", "rank", str(log), then, how],
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


if __name__ == "__main__":
    role = sys.argv[1]
    sys.exit(_rank(*sys.argv[2:5]) if role == "rank" else _child(sys.argv[2]))
