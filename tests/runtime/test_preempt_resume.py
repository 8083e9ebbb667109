"""Preemption: SIGUSR1 to the job -> checkpoint, exit 75 (requeue); the same command resumes.

The first `gyre run` gets SIGUSR1 on every rank (as Slurm's `--signal=USR1@T` does) after its
first optimizer step. It must record what ran, save the core's weights + optimizer and the
driver state, and exit with `EXIT_CHECKPOINTED`. Run again with the same run directory, it
continues from that policy version to S steps and exits 0; the first trace stays intact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.launch.task import EXIT_CHECKPOINTED
from gyre.trajectory.store import TraceReader

from .conftest import small_config, write_config


def _ranks(run_dir: Path) -> list[int]:
    """Pids of the job's ranks (`gyre.runtime.main ... --run-dir run_dir`)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        mine = b"gyre.runtime.main" in cmd and str(run_dir).encode() in cmd
        if mine and not any(c.endswith(b"mpiexec") for c in cmd):
            out.append(int(entry.name))
    return out


def _signal_after_first_step(proc: subprocess.Popen, run_dir: Path, seen: list[str]) -> bool:
    """Read `gyre run`'s progress lines; SIGUSR1 every rank once step 1 is reported."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if "step 1/" in line:
            for pid in _ranks(run_dir):
                os.kill(pid, signal.SIGUSR1)
            return True
    return False


@pytest.mark.mpi
@pytest.mark.slow
def test_sigusr1_checkpoints_and_the_same_command_resumes(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, steps=2)
    cfg["harness"]["tasks"] = ["add", "palindrome"]
    path = write_config(tmp_path, cfg)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre", "run", str(path), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        sent = _signal_after_first_step(proc, run_dir, seen)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + out
    assert sent, out[-3000:]
    assert proc.returncode == EXIT_CHECKPOINTED, out[-3000:]
    state = json.loads((run_dir / "checkpoint.json").read_text())
    assert state["updates"] == 1 and state["version"] == 1
    assert (run_dir / "checkpoint.pt").exists()
    with TraceReader(run_dir / "trace.h5") as r:
        first = {i.execution_id: i for i in r.executions()}
        assert all(i.closed for i in first.values())
        assert "preempted" in [e["kind"] for e in r.rows("events")]

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["resumed_from"]["updates"] == 1
    with TraceReader(run_dir / "trace.1.h5") as r:
        steps = {row["step"] for row in r.rows("steps")}
        versions = {row["policy_version"] for row in r.rows("groups")}
    assert steps == {2} and versions == {1}  # continued from the checkpoint's version
    with TraceReader(run_dir / "trace.h5") as r:  # the first segment is untouched
        assert {i.execution_id for i in r.executions()} == set(first)
