"""SIGKILL of every kind of process, during start-up and mid-run: nothing closed is lost.

The matrix (docs/runtime.md "Crashes and resume" holds the same table):

* an engine, a harness, a scorer (evaluator attempt): the job absorbs it — the engine is
  restarted, the harness's execution is scored from its preserved workspace, the scorer's
  attempt is retried — and the run completes by itself;
* the coordinator, the proxy node, the core cell's leader, a satellite cell's other rank
  (the chain runs 2-rank cells), everything at once: the job stops (MPI takes every rank down; engines, harnesses and scorers die with their
  parents); `gyre run --resume RUN_DIR` continues from the newest checkpoint and the trace.

Every victim is found by what it carries (tests/processes.py) and proven gone by pid. The
absorbed kinds die in one world, at start-up and again mid-run. For the fatal kinds a chain
of runs first preempts the job (SIGUSR1: checkpoint, exit 75, the same command resumes),
then kills one kind per segment (every kind mid-run; the core cell's leader and everything at
once also during start-up), then a last resume completes the run. Before and after
every kill the closed executions are read from the trace — status, a digest of the tree,
reward rows — and each one must survive unchanged into every later read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from processes import Proc, gone, scan, wait_for

from gyre.errors import StoreError
from gyre.runtime.checkpoint import EXIT_CHECKPOINTED, latest
from gyre.trajectory.reader import TraceReader

from .conftest import small_config, write_config

STEPS = 4
# a mid-run kill leaves at least two steps to go: with one, a loaded machine once finished the
# run between the kill's trigger and the kill (the next segment then had nothing to resume)


def _config(tmp_path: Path, record_batches: bool = False, ranks_per_cell: int = 1) -> Path:
    """A small world (coordinator, proxy node, core + one satellite) that starts quickly."""
    cfg = small_config(tmp_path, steps=STEPS)
    cfg["train"]["record_batches"] = record_batches
    cfg["topology"].update({"cells": 2, "ranks_per_cell": ranks_per_cell})
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
    """Past start-up and, where the run has steps left, one step further than it began
    (never past step STEPS - 2: two steps are left when the kill lands)."""
    first = _wait_steps(run_dir, proc, 0)
    _wait_steps(run_dir, proc, min(STEPS - 2, first + 1))


def _kill(victims: list[Proc]) -> list[int]:
    for p in victims:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(p.pid, signal.SIGKILL)
    return [p.pid for p in victims]


def _errors(run_dir: Path) -> str:
    """The job log's lines that are not progress lines (where a rank's error goes)."""
    log = run_dir / "job.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(x for x in lines if not x.startswith("GYRE-PROGRESS"))[-3000:]


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
def test_engine_harness_and_scorer_kills_are_absorbed(tmp_path: Path) -> None:
    """One world: the first engine, harness and scorer die during start-up, then another of
    each mid-run; the run completes by itself and each killed harness's work is scored."""
    run_dir = tmp_path / "run"
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    cfg["harness"].update({"suite": str(_slow_scoring_suite(tmp_path, run_dir)),
                           "tasks": ["notes"], "eval_attempts": 3})  # fmt: skip
    proc = _start([str(write_config(tmp_path, cfg)), "--run-dir", str(run_dir)])
    killed: list[int] = []
    harnesses: list[Proc] = []
    try:
        for phase in ("startup", "midrun"):
            if phase == "startup":  # the very first of each, as soon as it exists
                killed += _kill([wait_for(run_dir, "engine", 0)])
            else:
                _mid_run(run_dir, proc)
                killed += _kill([wait_for(run_dir, "engine", 1)])
            harnesses.append(wait_for(run_dir, "harness", exclude=killed))
            killed += _kill(harnesses[-1:])
            killed += _kill([wait_for(run_dir, "scorer", exclude=killed)])
        rc, out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, out[-3000:] + _errors(run_dir)
    assert gone(killed), "a killed process is still alive"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    with TraceReader(run_dir / "trace.h5") as r:
        execs = {i.execution_id: i for i in r.executions()}
        rows = r.rows("assessments")
        events = [e["kind"] for e in r.rows("events")]
    assert all(i.closed for i in execs.values())
    for harness in harnesses:
        killed_eid = next(e for e in execs if f"/{e}/" in harness.cmdline)
        assert execs[killed_eid].status == "failed"  # its harness died; the workspace was scored
        assert execs[killed_eid].meta["verdict"] in ("scored", "placeholder")
    retried = {r["execution_id"] for r in rows if not r["valid"]}
    assert len(retried) >= 2, "each killed scorer's attempt is recorded unresolved"
    for eid in retried:
        assert any(r["valid"] and r["execution_id"] == eid for r in rows), f"{eid} not retried"
    assert events.count("engine_lost") >= 1 and summary["engine_losses"] >= 1


# --------------------------------------------------------------------------- fatal kills

FATAL = {  # kind -> which processes to kill, by world rank in a world of 2-rank cells:
    # coordinator 0, proxy 1, core cell 2 (leader, hosts the engine) + 3, satellite 4 + 5
    "coordinator": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 0],
    "proxy node": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 1],
    "core cell's leader": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 2],
    "satellite cell's second rank": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 5],
    "everything": lambda ps: list(ps),
}


# start-up kills (each a world start of its own, ~35 s here): the rank that hosts an engine,
# and every process at once; any one rank's death ends the world the same way (MPI aborts it)
STARTUP_KILLS = ("core cell's leader", "everything")


def _closed(run_dir: Path) -> dict[str, Closed]:
    """Every closed execution of the trace on disk: its status, tree digest and reward rows.
    Read live (SWMR) before a kill as well as after it; empty while there is no trace yet."""
    if not (run_dir / "trace.h5").exists():
        return {}
    with TraceReader(run_dir / "trace.h5") as r:
        rewards: dict[str, list[tuple]] = {}
        for row in r.rows("rewards"):
            reward = float(row["reward"])  # NaN (no valid score) compares as None
            key = (
                row["group_id"],
                None if reward != reward else round(reward, 9),
                bool(row["valid"]),
            )
            rewards.setdefault(row["execution_id"], []).append(key)
        return {
            i.execution_id: Closed(i.status, _digest(r.tree(i.execution_id)),
                                   frozenset(rewards.get(i.execution_id, ())))
            for i in r.executions() if i.closed
        }  # fmt: skip


@dataclass(frozen=True)
class Closed:
    status: str
    tree: str  # sha256 of the tree's nodes: tokens, log-probs, parents, roles, versions
    rewards: frozenset  # (group, reward, valid) rows recorded for it so far

    def kept_in(self, later: Closed) -> bool:
        """Nothing of it is lost in `later`: same status and tree, every reward row still there
        (a resume may add the score of an execution that closed unscored)."""
        return (self.status, self.tree) == (
            later.status,
            later.tree,
        ) and self.rewards <= later.rewards


def _closed_live(run_dir: Path, known: dict[str, Closed]) -> dict[str, Closed]:
    """`_closed` of a running job's trace. The writer may hold the file outside SWMR mode for a
    moment (while it opens it); then what is known from the last segment stands in for it."""
    for _ in range(20):
        try:
            return _closed(run_dir)
        except (StoreError, OSError):
            time.sleep(0.1)
    return known


def _digest(tree: object) -> str:
    data = tree.to_dict()  # type: ignore[attr-defined]
    for node in data["nodes"]:  # wall-clock times are not content
        node.pop("t_start", None), node.pop("t_end", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _lost(before: dict[str, Closed], after: dict[str, Closed]) -> list[str]:
    """What of `before` is missing or changed in `after`, each as `id: before -> after`."""
    return [f"{e}: {c} -> {after.get(e)}" for e, c in before.items()
            if e not in after or not c.kept_in(after[e])]  # fmt: skip


def _ranks(run_dir: Path) -> list[int]:
    return [p.pid for p in scan(run_dir) if p.kind == "rank"]


def _preempt(run_dir: Path, args: list[str]) -> tuple[dict[str, Any], dict[str, Closed]]:
    """Segment 0: SIGUSR1 after the first optimizer step (what Slurm's --signal=USR1@T does):
    checkpoint, exit 75, nothing closed lost. Returns the checkpoint's core file and the
    closed executions."""
    proc = _start(args)
    try:
        _wait_steps(run_dir, proc, 1)
        before = _closed_live(run_dir, {})
        for pid in _ranks(run_dir):
            os.kill(pid, signal.SIGUSR1)
        rc, out = _finish(proc, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == EXIT_CHECKPOINTED, out[-3000:]
    found = latest(run_dir)
    assert found is not None and found[1]["updates"] == 1 and found[0].name == "v00001"
    saved = torch.load(found[0] / "core.pt", weights_only=True)
    closed = _closed(run_dir)
    assert not _lost(before, closed), "preemption lost closed executions"
    return saved, closed


def _kill_segment(run_dir: Path, kind: str, phase: str, closed: dict[str, Closed],
                  victims_of: Any) -> dict[str, Closed]:  # fmt: skip
    """A resumed segment in which `victims_of(processes)` are SIGKILLed at `phase`: the job
    stops, no process outlives it, nothing closed is lost. Returns the closed executions."""
    (run_dir / "job.log").unlink(missing_ok=True)  # the segment's own progress, from zero
    proc = _start(["--resume", str(run_dir)])
    try:
        if phase == "startup":  # before the first step of this segment
            wait_for(run_dir, "engine", 1)  # every rank is up, engines are starting
        else:
            _mid_run(run_dir, proc)
        victims = victims_of(scan(run_dir))
        assert victims, f"no {kind} process to kill among {scan(run_dir)}"
        everything = [p.pid for p in scan(run_dir)]
        before = _closed_live(run_dir, closed)
        _kill(victims)
        rc, _ = _finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0, f"{kind} killed {phase}: the job went on as if nothing happened"
    assert gone(everything), f"{kind} killed {phase}: processes outlived the job"
    after = _closed(run_dir)
    assert not _lost(before, after), f"{kind} killed {phase}: lost {_lost(before, after)}"
    assert not _lost(closed, after), f"{kind} killed {phase}: lost an earlier segment's"
    return after


def _completes(run_dir: Path, closed: dict[str, Closed], saved: dict[str, Any]) -> None:
    """The last resume finishes every step, keeps every closed execution, and its first
    update after the preemption started from exactly the checkpoint's parameters and AdamW
    state (step count and both moments; batch 0 keeps the first segment's record)."""
    rc, out = _finish(_start(["--resume", str(run_dir)]))
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    final = _closed(run_dir)
    assert closed and not _lost(closed, final)
    with TraceReader(run_dir / "trace.h5") as r:
        assert all(i.closed for i in r.executions()), "an execution stayed open after the resume"
        events = [(e["kind"], json.loads(e["detail"] or "{}")) for e in r.rows("events")]
    resumed = [d for k, d in events if k == "resumed"]
    assert resumed and "preempted" in [k for k, _ in events]
    assert resumed[0]["carried"], "groups scored but not trained before the preemption"
    assert torch.load(run_dir / "batches" / "b00000-core.pt", weights_only=False)["version"] == 0
    resumed_core = torch.load(run_dir / "batches" / "b00001-core.pt", weights_only=False)
    assert resumed_core["version"] == 1
    flat = torch.cat([t.reshape(-1) for t in dict(saved["named"]).values()])
    assert torch.equal(resumed_core["params_before"], flat)
    got, want = resumed_core["optimizer_before"]["state"][0], saved["optimizer"]["state"][0]
    assert int(got["step"]) == int(want["step"]) == 1
    assert torch.equal(got["exp_avg"], want["exp_avg"])
    assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])


@pytest.mark.mpi
@pytest.mark.slow
def test_fatal_kills_resume_and_lose_nothing_closed(tmp_path: Path) -> None:
    """One run: first preempted (SIGUSR1 -> checkpoint, exit 75), then resumed after each fatal
    kill of every kind, during start-up and mid-run. Before every kill the closed executions
    (status, tree digest, reward rows) are read from the live trace; after it, and at the end,
    every one of them is still there, unchanged. Finished, it continues for one more step
    from its last update."""
    run_dir = tmp_path / "run"
    args = [str(_config(tmp_path, record_batches=True, ranks_per_cell=2)), "--run-dir",
            str(run_dir)]  # fmt: skip
    saved, closed = _preempt(run_dir, args)
    kills = [(kind, phase) for kind in FATAL for phase in ("startup", "midrun")
             if phase == "midrun" or kind in STARTUP_KILLS]  # fmt: skip
    for kind, phase in kills:
        closed = _kill_segment(run_dir, kind, phase, closed, FATAL[kind])
    _completes(run_dir, closed, saved)
    with TraceReader(run_dir / "trace.h5") as r:
        resumed = [e for e in r.rows("events") if e["kind"] == "resumed"]
    # every mid-run segment continued a previous one (start-up kills may precede the takeover)
    assert len(resumed) >= len(FATAL)

    # the finished run ends with a checkpoint of its last update, and `--resume RUN --steps
    # MORE` continues from exactly that: its first update starts from the final parameters
    last = latest(run_dir)
    assert last is not None and last[1]["updates"] == STEPS and last[0].name == f"v{STEPS:05d}"
    rc, out = _finish(_start(["--resume", str(run_dir), "--steps", str(STEPS + 1)]))
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == {"version": STEPS, "updates": STEPS}
    assert summary["steps_done"] == STEPS + 1
    final = torch.load(last[0] / "core.pt", weights_only=True)
    more = torch.load(run_dir / "batches" / f"b{STEPS:05d}-core.pt", weights_only=False)
    assert more["version"] == STEPS
    flat = torch.cat([t.reshape(-1) for t in dict(final["named"]).values()])
    assert torch.equal(more["params_before"], flat)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [1, 2])
def test_a_megatron_core_resumes_from_its_checkpoint(tmp_path: Path, pipeline: int) -> None:
    """The same chain with Megatron model-parallel cells (train.backend megatron, TP = 2, or
    two pipeline stages): preempted, then the core cell's second rank — the other half of
    every core layer, or the second stage, and its own AdamW shard — killed mid-run, then
    resumed to the end. The checkpoint holds the gathered Hugging Face-layout weights and
    moments, and the first update after the preemption starts from exactly them on both
    shards (the recorded update is gathered)."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (gyre[gpu])")
    run_dir = tmp_path / "run"
    config = str(_config(tmp_path, record_batches=True, ranks_per_cell=2))
    args = [config, "train.backend=megatron", f"train.parallel.pipeline={pipeline}",
            "--run-dir", str(run_dir)]  # fmt: skip
    saved, closed = _preempt(run_dir, args)
    second = "core cell's second rank"  # world rank 3: the other TP half, or the second stage
    closed = _kill_segment(run_dir, second, "midrun", closed,
                           lambda ps: [p for p in ps if p.kind == "rank" and p.index == 3])  # fmt: skip
    _completes(run_dir, closed, saved)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_backend"] == "megatron"
    parallel = summary["parallel"]
    assert (parallel["tensor"], parallel["pipeline"]) == (2 // pipeline, pipeline)
