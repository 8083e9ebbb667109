"""Preemption: SIGUSR1 to the job -> checkpoint, exit 75 (requeue); the same command resumes.

The first `gyre run` gets SIGUSR1 on every rank (as Slurm's `--signal=USR1@T` does) after its
first optimizer step. It must record what ran, save the core's weights + optimizer and the
driver state, and exit with `EXIT_CHECKPOINTED`. Run again with the same command and run
directory (what a requeued Slurm job does), it continues from that policy version to S
steps and exits 0, appending to the same trace; the resumed core starts from exactly the
checkpoint's parameters and AdamW state (step count and both moments), read back from the
resumed run's own batch records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.runtime.checkpoint import EXIT_CHECKPOINTED, latest
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
    cfg["harness"]["params"].update({"max_turns": "2", "max_tokens": "96"})
    cfg["checkpoint"] = {"every_steps": 0}  # only the preemption checkpoints
    cfg["train"]["record_batches"] = True
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
    found = latest(run_dir)
    assert found is not None
    folder, state = found
    assert state["updates"] == 1 and state["version"] == 1 and folder.name == "v00001"
    saved = torch.load(folder / "core.pt", weights_only=True)
    with TraceReader(run_dir / "trace.h5") as r:
        first = {i.execution_id: i.status for i in r.executions()}
        assert all(i.closed for i in r.executions())
        assert "preempted" in [e["kind"] for e in r.rows("events")]

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["resumed_from"] == {"version": 1, "updates": 1}
    with TraceReader(run_dir / "trace.h5") as r:  # one trace: the first segment, then more
        now = {i.execution_id: i.status for i in r.executions()}
        steps = {row["step"] for row in r.rows("steps")}
        resumed = [e for e in r.rows("events") if e["kind"] == "resumed"]
    assert first.items() <= now.items()  # nothing the first segment closed is lost
    assert steps == {1, 2} and len(resumed) == 1
    carried = json.loads(resumed[0]["detail"])["carried"]
    assert carried, "the groups scored but not trained before the preemption are trained after"
    # the resumed core's first update started from the checkpoint, exactly
    # the first segment's batch 0 keeps its records; the resumed update is batch 1
    assert sorted(p.name for p in (run_dir / "batches").glob("b*-core.pt")) == [
        "b00000-core.pt", "b00001-core.pt"]  # fmt: skip
    assert torch.load(run_dir / "batches" / "b00000-core.pt", weights_only=False)["version"] == 0
    resumed_core = torch.load(run_dir / "batches" / "b00001-core.pt", weights_only=False)
    assert resumed_core["version"] == 1
    named = dict(saved["named"])
    flat = torch.cat([t.reshape(-1) for t in named.values()])
    assert torch.equal(resumed_core["params_before"], flat)
    before = resumed_core["optimizer_before"]["state"][0]
    want = saved["optimizer"]["state"][0]
    assert int(before["step"]) == int(want["step"]) == 1
    assert torch.equal(before["exp_avg"], want["exp_avg"])
    assert torch.equal(before["exp_avg_sq"], want["exp_avg_sq"])
