"""Nothing a real run would refuse gets past the preflight (issue 49, part B): the cases that
need a process of their own. The one-line refusals themselves (a model family the backend
cannot train, a vocabulary smaller than the tokenizer, a model the engine cannot batch,
CUDA without GPUs, adapter params by type, tracker URIs, `slurm.log_dir`, the run directory,
resume compatibility) are rows of the bad-input corpus, tests/test_bad_input_corpus.py.

Here, each a real process as a user types it: a damaged trace refused by `--resume` (the
run's files byte for byte as they were), a harness program the login node lacks (a note
there, an error where the job runs), a dry run that says what it would write and writes
nothing, and a resume the checks must let through. The run directory a resume continues is
the `resumable_run` of tests/conftest.py, built as the runtime writes one, not run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_cli_errors import ROOT, gyre, one_line_error

LOCAL = ROOT / "templates" / "local.yaml"
CLUSTER_CPU = ROOT / "templates" / "cluster-cpu.yaml"


def digest(root: Path) -> dict[str, str]:
    """Every file under `root` -> the hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def in_job(config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The job's first step, as the batch script runs it."""
    return subprocess.run([sys.executable, "-m", "gyre.launch.check", str(config)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)  # fmt: skip


def one_line_job_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    """`one_line_error` for `python -m gyre.launch.check`, whose lines start `gyre: error:`."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("gyre: error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and all(n in lines[0] for n in needles), lines[0]


def variant(tmp: Path, name: str, source: Path = LOCAL, **sections: dict) -> Path:
    """`source` with some keys set (`{"train": {"backend": "megatron"}}`), runs_dir in `tmp`."""
    data = yaml.safe_load(source.read_text())
    data["runs_dir"] = str(tmp / "runs")
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def run(resumable_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "runs" / resumable_run.name
    shutil.copytree(resumable_run, copy)
    return copy


def refused(out: subprocess.CompletedProcess[str], before: dict[str, str], root: Path,
            *needles: str) -> None:  # fmt: skip
    one_line_error(out, *needles)
    assert digest(root) == before, "an input file changed"


# -- the model against the backends -------------------------------------------------------


# -- devices, harness params, trackers, Slurm, the run directory ----------------------------


FAKE_SCONTROL = """#!/bin/sh
case "$2" in
  partition) echo "PartitionName=cpu Default=YES TotalNodes=8 MaxNodes=UNLIMITED MaxTime=UNLIMITED State=UP" ;;
  node) echo "NodeName=n1 Partitions=cpu CPUTot=16 Gres=(null) State=IDLE" ;;
esac
"""


def test_a_missing_harness_program_is_a_note_on_the_login_node_an_error_where_it_runs(
    tmp_path: Path,
) -> None:
    """The login node may lack the harness only the compute nodes have: `render --check`
    passes with a note; `gyre run` here and the job's first step refuse it."""
    ghost = {"api": "openai", "command": ["gyre-no-such-harness", "{instruction}"]}
    harness = {"adapter": "ghost", "params": {}, "adapters": {"ghost": ghost}}
    config = variant(tmp_path, "ghost", CLUSTER_CPU, harness=harness)
    needles = ["harness.adapter: 'ghost'", "gyre-no-such-harness"]
    one_line_error(gyre("run", str(variant(tmp_path, "here", harness=harness)), "--dry-run"),
                   *needles)  # fmt: skip
    one_line_job_error(in_job(config), *needles)
    fake = tmp_path / "bin" / "scontrol"  # a login node's Slurm: one partition of 8 nodes
    fake.parent.mkdir()
    fake.write_text(FAKE_SCONTROL)
    fake.chmod(0o755)
    login = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    script = tmp_path / "job.sbatch"
    out = gyre("render", str(config), "--check", "-o", str(script), env=login)
    assert out.returncode == 0 and script.is_file(), out.stderr
    assert "gyre render: warning: not checked here: harness.adapter: 'ghost'" in out.stderr


def test_dry_run_says_what_it_would_write_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "dry"
    out = gyre("run", str(LOCAL), f"runs_dir={tmp_path}/runs", "--run-dir", str(run_dir),
               "--dry-run")  # fmt: skip
    assert out.returncode == 0, out.stderr
    said, command = out.stdout.strip().splitlines()[-2:]
    assert "would start 5 ranks" in said
    assert f"writing the merged config to {run_dir / 'config.yaml'} first" in said
    assert f"gyre.runtime.main {run_dir / 'config.yaml'} --run-dir {run_dir}" in command
    assert not run_dir.exists()


# -- resume --------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_resume_refuses_a_damaged_trace(run: Path, damage: str) -> None:
    trace = run / "trace.h5"
    data = trace.read_bytes()
    trace.write_bytes(
        data[: len(data) // 2] if damage == "truncated" else b"\x5a" * 4096 + data[4096:]
    )
    before = digest(run)
    refused(gyre("run", "--resume", str(run)), before, run, f"--resume {run}", "trace", "allowed")


def test_a_resume_it_can_continue_passes(run: Path) -> None:
    """The checks refuse only what the ranks would: more steps, same shape, same groups."""
    before = digest(run)
    out = gyre("run", "--resume", str(run), "--steps", "8", "train.lr=3e-4", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"writing the merged config to {run / 'config.resume.yaml'} first" in out.stdout
    assert digest(run) == before
