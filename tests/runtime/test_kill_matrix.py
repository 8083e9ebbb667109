"""SIGKILL of every kind of process, during start-up and mid-run: nothing closed is lost.

The matrix (docs/runtime.md "Crashes and resume" holds the same table):

* an engine, a harness, a scorer (evaluator attempt): the job absorbs it — the engine is
  restarted, the harness's execution is scored from its preserved workspace, the scorer's
  attempt is retried — and the run completes by itself;
* the coordinator, the proxy node, the core cell's leader, a satellite cell's other rank
  (the chain runs 2-rank cells), a Megatron core's second rank, everything at once: the job
  stops (MPI takes every rank down; engines, harnesses and scorers die with their parents);
  `gyre run --resume RUN_DIR` continues from the newest checkpoint and the trace.

Every victim is found by what it carries (tests/processes.py) and proven gone by pid. The
absorbed kinds die in one world, at start-up and again mid-run. For the fatal kinds a chain
of runs first preempts the job (SIGUSR1: checkpoint, exit 75, the same command resumes),
then kills one kind per segment (every kind mid-run; the core cell's leader and everything at
once also during start-up), then a last resume completes the run. Before and after
every kill the closed executions are read from the trace — status, a digest of the tree,
reward rows — and each one must survive unchanged into every later read; every resumed
segment's first update starts from exactly the checkpoint it resumed. The torch chain is the
session's shared `torch_chain` (tests/worlds.py `torch_world`), whose recorded updates
test_training_invariance.py also replays against the one-process reference.

The Megatron core's chain is the session's shared `megatron_chain` (tests/worlds.py, also
replayed by test_training_invariance.py): preempted under tensor parallelism (TP 2), resumed
under two pipeline stages (`--resume RUN_DIR train.parallel.pipeline=2`) with the core cell's
second rank killed mid-run, resumed under TP 2 again to the end — its checkpoints hold the
Hugging Face layout, so a run continues under another layout. Both chains are built from the
same pieces (`preempt`, `kill_during`, `resume`, each a `Segment` record).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import yaml
from processes import Proc, age, gone, scan, wait_for
from worlds import (
    CHAIN_STEPS,
    FATAL,
    FATAL_KILLS,
    Chain,
    Closed,
    Segment,
    finish,
    job_errors,
    kill,
    lost,
    mid_run,
    start_run,
)

from gyre.runtime.shared.checkpoint import EXIT_CHECKPOINTED, latest
from gyre.trajectory.reader import TraceReader

from .conftest import small_config, write_config

STEPS = CHAIN_STEPS  # a mid-run kill leaves two steps to go (tests/worlds.py)


def _config(tmp_path: Path, record_batches: bool = False, ranks_per_cell: int = 1) -> Path:
    """A small world (coordinator, proxy node, core + one satellite) that starts quickly."""
    cfg = small_config(tmp_path, steps=STEPS)
    cfg["train"]["record_batches"] = record_batches
    cfg["topology"].update({"cells": 2, "ranks_per_cell": ranks_per_cell})
    cfg["harness"]["params"].update({"max_turns": "2", "max_tokens": "96"})
    cfg["checkpoint"] = {"every_steps": 1, "keep": 2}
    return write_config(tmp_path, cfg)


# --------------------------------------------------------------------------- absorbed kills


def _slow_scoring_suite(tmp_path: Path, run_dir: Path) -> Path:
    """The notes task, scored by a checker that first sleeps (so a scorer can be killed)."""
    from gyre.tasks.suite import LEARN_DIR

    notes = LEARN_DIR / "notes"
    slow = tmp_path / "slow_score.py"
    slow.write_text(  # the checker is named on the command line: the scorer's sandbox shows it
        "import runpy, sys, time\n"
        "time.sleep(1.5)\n"
        "sys.argv = sys.argv[2:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    suite = {"name": "slow", "tasks": [{
        "name": "notes", "instruction": "Take notes: one file per note, each a bullet.",
        "workspace": str(notes / "workspace"),
        # the run directory rides along as an argument: the scorer is findable by it
        "scoring": {"rule": "command", "timeout_s": 30, "command": [
            "python3", str(slow), str(run_dir.resolve()), str(notes / "hidden" / "check_notes.py"),
            "--initial", str(notes / "workspace")]},
    }]}  # fmt: skip
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def _fresh_scorers(run_dir: Path, exclude: list[int], timeout: float = 240) -> list[Proc]:
    """The scorers that started in the last 0.5 s: each still in the slow checker's first
    1.5 s, so a kill lands before it can score (an older one may be printing its score)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = [p for p in scan(run_dir)
                 if p.kind == "scorer" and p.pid not in exclude and age(p.pid) < 0.5]  # fmt: skip
        if fresh:
            return fresh
        time.sleep(0.05)
    raise AssertionError(f"no scorer started within {timeout}s")


def _sessions(procs: list[Proc]) -> set[int]:
    """The sessions `procs` belong to (a scoring process starts one, `run_limited`)."""
    out = set()
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            out.add(os.getsid(p.pid))
    return out


@pytest.mark.mpi
@pytest.mark.slow
def test_engine_harness_and_scorer_kills_are_absorbed(tmp_path: Path) -> None:
    """One world: the first engine, harness and scorer die during start-up, then another of
    each mid-run; the run completes by itself and each killed harness's work is scored."""
    run_dir = tmp_path / "run"
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    cfg["harness"].update({"suite": str(_slow_scoring_suite(tmp_path, run_dir)),
                           "tasks": ["notes"], "eval_attempts": 3})  # fmt: skip
    proc = start_run([str(write_config(tmp_path, cfg)), "--run-dir", str(run_dir)])
    killed: list[int] = []
    harnesses: list[Proc] = []
    scorers_killed = 0
    try:
        for phase in ("startup", "midrun"):
            if phase == "startup":  # the very first of each, as soon as it exists
                killed += kill([wait_for(run_dir, "engine", 0)])
            else:
                mid_run(run_dir, proc)
                killed += kill([wait_for(run_dir, "engine", 1)])
            harnesses.append(wait_for(run_dir, "harness", exclude=killed))
            killed += kill(harnesses[-1:])
            scorers = _fresh_scorers(run_dir, exclude=killed)
            attempts = _sessions(scorers)  # one scoring: its sandbox's processes and the checker
            killed += kill(scorers)
            scorers_killed += len(attempts)
            assert gone([p.pid for p in scorers]), "a killed scorer is still alive"
        rc, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, out[-3000:] + job_errors(run_dir)
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
    # an unresolved attempt per scorer killed (each in its first 1.5 s); the mid-run round may
    # kill the start-up round's retry, so two attempts can name one execution
    unresolved = [(r["execution_id"], r["state_ref"], r["attempt"]) for r in rows if not r["valid"]]
    assert len(set(unresolved)) >= scorers_killed >= 2, (unresolved, scorers_killed)
    for eid in {u[0] for u in unresolved}:
        assert any(r["valid"] and r["execution_id"] == eid for r in rows), f"{eid} not retried"
    assert events.count("engine_lost") >= 1 and summary["engine_losses"] >= 1


# --------------------------------------------------------------------------- fatal kills


def _preempted(seg: Segment) -> None:
    """Segment 0, SIGUSR1 after the first optimizer step: checkpoint of that update, exit 75,
    nothing closed lost."""
    assert not seg.error, f"{seg.error}\n{seg.output}"
    assert seg.returncode == EXIT_CHECKPOINTED, seg.output
    found = seg.checkpoint
    assert found is not None and found.state["updates"] == 1 and found.name == "v00001"
    assert not lost(seg.closed_before, seg.closed_after), "preemption lost closed executions"


def _killed(seg: Segment, kind: str, phase: str, earlier: dict[str, Closed]) -> None:
    """A resumed segment whose `kind` was SIGKILLed at `phase`: the job stopped, no process
    outlived it, nothing closed before the kill (nor in `earlier` segments) is lost."""
    what = f"{kind} killed {phase}"
    assert not seg.error, f"{what}: {seg.error}\n{seg.output}"
    assert seg.killed, f"{what}: nothing was killed"
    assert seg.returncode != 0, f"{what}: the job went on as if nothing happened"
    assert not seg.outlived, f"{what}: processes outlived the job"
    after = seg.closed_after
    assert not lost(seg.closed_before, after), f"{what}: lost {lost(seg.closed_before, after)}"
    assert not lost(earlier, after), f"{what}: lost an earlier segment's"


def _started_from_checkpoint(seg: Segment) -> None:
    """The segment's first update started from exactly the checkpoint it resumed: parameters
    and AdamW state (step count and both moments), gathered from every shard."""
    got, saved = seg.first_update, seg.resumed_from
    assert got is not None and saved is not None, f"{seg.args}: no update after its resume"
    assert got["version"] == saved.core["version"], seg.args
    flat = torch.cat([t.reshape(-1) for t in dict(saved.core["named"]).values()])
    assert torch.equal(got["params_before"], flat), f"{seg.args}: not the checkpoint's weights"
    have, want = got["optimizer_before"]["state"][0], saved.core["optimizer"]["state"][0]
    assert int(have["step"]) == int(want["step"]), seg.args
    for moment in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(have[moment], want[moment]), f"{seg.args}: not the checkpoint's {moment}"


def _completed(run_dir: Path, segments: Sequence[Segment]) -> None:
    """The last segment, a resume left to finish, does every step and keeps every closed
    execution; every resumed segment that updated started from exactly its checkpoint (the
    first resume's: the preemption's, one AdamW step in; batch 0 keeps the first segment's
    record)."""
    last = segments[-1]
    assert not last.error and last.returncode == 0, f"{last.error}\n{last.output}"
    assert last.summary["steps_done"] == STEPS
    earlier = segments[-2].closed_after
    assert earlier and not lost(earlier, last.closed_after)
    with TraceReader(run_dir / "trace.h5") as r:
        assert all(i.closed for i in r.executions()), "an execution stayed open after the resume"
        events = [(e["kind"], json.loads(e["detail"] or "{}")) for e in r.rows("events")]
    resumed = [d for k, d in events if k == "resumed"]
    assert resumed and "preempted" in [k for k, _ in events]
    assert resumed[0]["carried"], "groups scored but not trained before the preemption"
    assert torch.load(run_dir / "batches" / "b00000-core.pt", weights_only=False)["version"] == 0
    first = segments[1]
    assert first.first_update is not None and first.first_batch == 1
    assert int(first.first_update["optimizer_before"]["state"][0]["step"]) == 1
    for seg in segments[1:]:
        if seg.first_update is not None:
            _started_from_checkpoint(seg)


@pytest.mark.mpi
@pytest.mark.slow
def test_fatal_kills_resume_and_lose_nothing_closed(torch_chain: Chain) -> None:
    """One run (the session's `torch_chain`, tests/worlds.py): first preempted (SIGUSR1 ->
    checkpoint, exit 75), then resumed after each fatal kill of every kind, during start-up
    and mid-run (`FATAL_KILLS`). Before every kill the closed executions (status, tree
    digest, reward rows) are read from the live trace; after it, and at the end, every one of
    them is still there, unchanged. Finished, it continues for one more step from its last
    update."""
    segments = torch_chain.segments
    assert len(segments) == 1 + len(FATAL_KILLS) + 2, f"{segments[-1].error}\n{segments[-1].output}"
    _preempted(segments[0])
    for (kind, phase), seg, before in zip(FATAL_KILLS, segments[1:], segments, strict=False):
        _killed(seg, kind, phase, before.closed_after)
    *chain, more = segments
    _completed(torch_chain.run_dir, chain)
    with TraceReader(torch_chain.run_dir / "trace.h5") as r:
        resumed = [e for e in r.rows("events") if e["kind"] == "resumed"]
    # every mid-run segment continued a previous one (start-up kills may precede the takeover)
    assert len(resumed) >= len(FATAL)

    # the finished run ends with a checkpoint of its last update, and `--resume RUN --steps
    # MORE` continues from exactly that: its first update starts from the final parameters
    last = chain[-1].checkpoint
    assert last is not None and last.state["updates"] == STEPS and last.name == f"v{STEPS:05d}"
    assert more.resumed_from is not None and more.resumed_from.name == last.name
    assert not more.error and more.returncode == 0, f"{more.error}\n{more.output}"
    assert more.summary["resumed_from"] == {"version": STEPS, "updates": STEPS}
    assert more.summary["steps_done"] == STEPS + 1
    assert more.first_batch == STEPS
    _started_from_checkpoint(more)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_megatron_core_resumes_from_its_checkpoint(megatron_chain: Chain) -> None:
    """The same chain with Megatron model-parallel cells (train.backend megatron, 2-rank
    cells; tests/worlds.py `megatron_world`): preempted under TP = 2 (each rank a half of
    every layer, with its own AdamW shard), resumed under two pipeline stages
    (`--resume RUN_DIR train.parallel.pipeline=2`) and the core cell's second rank — the
    second stage — killed mid-run, then resumed under TP = 2 (`train.parallel.pipeline=1`)
    to the end. Each core rank writes its own shard of the checkpoint (main weights and
    moments, nothing gathered), and a resume under other sizes puts them together into the
    Hugging Face layout: each resume's first update, one per layout, starts from exactly them
    on every shard (the recorded update is gathered). A resume's overrides are taken and
    recorded in the run's config.yaml."""
    segments = megatron_chain.segments
    assert len(segments) == 3, f"{segments[-1].error}\n{segments[-1].output}"
    preempted, killed, finished = segments
    _preempted(preempted)
    _killed(killed, "core cell's second rank", "midrun", preempted.closed_after)
    _completed(megatron_chain.run_dir, segments)
    assert [s.layout for s in segments] == [(2, 1), (1, 2), (2, 1)]  # (tensor, pipeline)
    assert killed.first_update is not None and finished.first_update is not None
    found = latest(megatron_chain.run_dir)
    assert found is not None
    assert not (found[0] / "core.pt").exists()  # nothing gathered to one rank
    assert sorted(p.name for p in (found[0] / "shards").iterdir()) == [
        "rank-00000.safetensors", "rank-00001.safetensors"]  # fmt: skip
    summary = json.loads((megatron_chain.run_dir / "summary.json").read_text())
    assert summary["train_backend"] == "megatron"
    parallel = summary["parallel"]
    assert (parallel["tensor"], parallel["pipeline"]) == (2, 1)
