"""SIGKILL of every kind of process, during start-up and mid-run: nothing closed is lost.

The matrix (docs/runtime.md "Crashes and resume" holds the same table):

* an engine, a harness, a scorer (evaluator attempt): the job absorbs it — the engine is
  restarted, the harness's execution is scored from its preserved workspace, the scorer's
  attempt is retried — and the run completes by itself;
* the coordinator, the proxy node, the core's rank, a satellite's rank, everything at once:
  the job stops (MPI takes every rank down; engines, harnesses and scorers die with their
  parents); `gyre run --resume RUN_DIR` continues from the newest checkpoint and the trace.

Every victim is found by what it carries (tests/processes.py) and proven gone by pid. For
the fatal kinds a chain of runs kills one kind per segment, then a last resume completes
the run; every execution closed before any kill must still be closed in the final trace.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from processes import Proc, gone, scan, wait_for

from gyre.trajectory.reader import TraceReader

from .conftest import small_config, write_config

STEPS = 3


def _config(tmp_path: Path) -> Path:
    """A small world (coordinator, proxy node, core + one satellite) that starts quickly."""
    cfg = small_config(tmp_path, steps=STEPS)
    cfg["topology"]["cells"] = 2
    cfg["harness"]["params"].update({"max_turns": "2", "max_tokens": "96"})
    cfg["checkpoint"] = {"every_steps": 1, "keep": 2}
    return write_config(tmp_path, cfg)


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gyre", "run", *args, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _steps_done(run_dir: Path) -> int:
    """The step count of the current segment's progress lines (-1: none yet)."""
    log = run_dir / "job.log"
    done = -1
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("GYRE-PROGRESS "):
                try:
                    done = max(done, json.loads(line.split(" ", 1)[1])["step"])
                except (ValueError, KeyError):
                    continue
    return done


def _wait_steps(run_dir: Path, proc: subprocess.Popen[str], n: int, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while (done := _steps_done(run_dir)) < n:
        assert proc.poll() is None, f"the run ended before step {n}"
        assert time.monotonic() < deadline, f"no step {n} within {timeout}s"
        time.sleep(0.2)
    return done


def _mid_run(run_dir: Path, proc: subprocess.Popen[str]) -> None:
    """Past start-up and, where the run has steps left, one step further than it began."""
    first = _wait_steps(run_dir, proc, 0)
    _wait_steps(run_dir, proc, min(STEPS - 1, first + 1))


def _kill(victims: list[Proc]) -> list[int]:
    for p in victims:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(p.pid, signal.SIGKILL)
    return [p.pid for p in victims]


def _closed(run_dir: Path) -> dict[str, str]:
    with TraceReader(run_dir / "trace.h5") as r:
        return {i.execution_id: i.status for i in r.executions() if i.closed}


def _finish(proc: subprocess.Popen[str], timeout: float = 400) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


# --------------------------------------------------------------------------- absorbed kills


def _slow_scoring_suite(tmp_path: Path, run_dir: Path) -> Path:
    """The notes task, scored by a checker that first sleeps (so a scorer can be killed)."""
    from gyre.tasks.suite import LEARN_DIR

    notes = LEARN_DIR / "notes"
    slow = tmp_path / "slow_score.py"
    slow.write_text(
        "import runpy, sys, time\n"
        "time.sleep(1.5)\n"
        f"sys.argv = [{str(notes / 'hidden' / 'check_notes.py')!r}, *sys.argv[2:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    suite = {"name": "slow", "tasks": [{
        "name": "notes", "instruction": "Take notes: one file per note, each a bullet.",
        "workspace": str(notes / "workspace"),
        # the run directory rides along as an argument: the scorer is findable by it
        "scoring": {"rule": "command", "timeout_s": 30, "command": [
            "python3", str(slow), str(run_dir.resolve()), "--initial", str(notes / "workspace")]},
    }]}  # fmt: skip
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["startup", "midrun"])
def test_engine_harness_and_scorer_kills_are_absorbed(tmp_path: Path, phase: str) -> None:
    run_dir = tmp_path / "run"
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    cfg["harness"].update({"suite": str(_slow_scoring_suite(tmp_path, run_dir)),
                           "tasks": ["notes"], "eval_attempts": 3})  # fmt: skip
    proc = _start([str(write_config(tmp_path, cfg)), "--run-dir", str(run_dir)])
    try:
        if phase == "startup":  # the very first of each, as soon as it exists
            victims = [wait_for(run_dir, "engine", 0)]
        else:
            _mid_run(run_dir, proc)
            victims = [wait_for(run_dir, "engine", 1)]
        killed = _kill(victims)
        harness = wait_for(run_dir, "harness")
        killed += _kill([harness])
        killed += _kill([wait_for(run_dir, "scorer")])
        rc, out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, out[-3000:]
    assert gone(killed), "a killed process is still alive"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    with TraceReader(run_dir / "trace.h5") as r:
        execs = {i.execution_id: i for i in r.executions()}
        rows = r.rows("assessments")
        events = [e["kind"] for e in r.rows("events")]
    assert all(i.closed for i in execs.values())
    killed_eid = next(e for e in execs if f"/{e}/" in harness.cmdline)
    assert execs[killed_eid].status == "failed"  # its harness died; the workspace was scored
    assert execs[killed_eid].meta["verdict"] in ("scored", "placeholder")
    retried = [r for r in rows if not r["valid"]]
    assert retried, "the killed scorer's attempt is recorded unresolved and was retried"
    assert any(r["valid"] and r["execution_id"] == retried[0]["execution_id"] for r in rows)
    if phase == "midrun":
        assert "engine_lost" in events and summary["engine_losses"] >= 1


# --------------------------------------------------------------------------- fatal kills

FATAL = {  # kind -> which processes to kill (world ranks: coordinator, proxy, core, satellite)
    "coordinator": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 0],
    "proxy node": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 1],
    "core cell": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 2],
    "satellite cell": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 3],
    "everything": lambda ps: list(ps),
}


@pytest.mark.mpi
@pytest.mark.slow
def test_fatal_kills_resume_and_lose_nothing_closed(tmp_path: Path) -> None:
    """One run, resumed after each fatal kill: every kind, during start-up and mid-run."""
    run_dir = tmp_path / "run"
    args = [str(_config(tmp_path)), "--run-dir", str(run_dir)]
    closed_before: dict[str, str] = {}
    kills = [(kind, phase) for kind in FATAL for phase in ("startup", "midrun")]
    for kind, phase in kills:
        (run_dir / "job.log").unlink(missing_ok=True)  # the segment's own progress, from zero
        proc = _start(args)
        try:
            if phase == "startup":  # before the first step of this segment
                wait_for(run_dir, "engine", 1)  # every rank is up, engines are starting
            else:
                _mid_run(run_dir, proc)
            victims = FATAL[kind](scan(run_dir))
            assert victims, f"no {kind} process to kill among {scan(run_dir)}"
            everything = [p.pid for p in scan(run_dir)]
            _kill(victims)
            rc, out = _finish(proc, timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert rc != 0, f"{kind} killed {phase}: the job went on as if nothing happened"
        assert gone(everything), f"{kind} killed {phase}: processes outlived the job"
        if (run_dir / "trace.h5").exists():
            closed_now = _closed(run_dir)
            assert closed_before.items() <= closed_now.items(), f"{kind} {phase}: lost executions"
            closed_before = closed_now
        args = ["--resume", str(run_dir)]
    rc, out = _finish(_start(args))
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    assert closed_before and closed_before.items() <= _closed(run_dir).items()
    with TraceReader(run_dir / "trace.h5") as r:
        assert all(i.closed for i in r.executions()), "an execution stayed open after the resume"
        resumed = [e for e in r.rows("events") if e["kind"] == "resumed"]
    # every mid-run segment continued a previous one (start-up kills may precede the takeover)
    assert len(resumed) >= len(FATAL)
