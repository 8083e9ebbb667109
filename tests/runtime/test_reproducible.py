"""A run's sampling follows its seed: `gyre eval` of one run twice gives the same result.

Every sampled call's seed derives from `train.seed`, the execution and the call index
(`gyre.proxy.service.call_seed`), so the same policy on the same held-out instances makes
the same calls, the harness does the same things and the evaluator gives the same rewards,
whatever order the engine batches the calls in. (Unseeded, two evaluations of the tiny model
differed in rewards, agent reports and workspaces.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _run_dir(tmp: Path) -> Path:
    """A run directory as `gyre run` leaves it, for what `gyre eval` reads: its config and
    its final policy (the tiny model, unchanged)."""
    from gyre.models import load_model
    from gyre.runtime.shared.config import DEFAULT_CONFIG
    from gyre.runtime.shared.policies import save_policy

    run_dir = tmp / "run"
    run_dir.mkdir()
    shutil.copy(DEFAULT_CONFIG, run_dir / "config.yaml")
    model, tokenizer = load_model("tiny")
    save_policy(run_dir, "final", model, tokenizer, version=0)
    return run_dir


def _eval(run_dir: Path) -> tuple[dict, dict[str, bytes]]:
    proc = subprocess.run(
        [sys.executable, "-m", "gyre", "eval", str(run_dir), "--instances", "4", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    root = run_dir / "eval" / "final" / "workspaces"
    files = {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "stderr.log"  # stderr: library warnings, not behaviour
    }
    return result, files


@pytest.mark.slow
def test_gyre_eval_twice_on_one_run_directory_gives_identical_executions(tmp_path: Path) -> None:
    """The second evaluation runs in the same work directory as the first (RUN_DIR/eval):
    it must score afresh, not trip over the first one's executions."""
    run_dir = _run_dir(tmp_path)
    first, first_files = _eval(run_dir)
    recorded = json.loads((run_dir / "eval.json").read_text())["results"]
    between = time.time()
    second, second_files = _eval(run_dir)
    reports = list((run_dir / "eval" / "final" / "workspaces").glob("*/stdout.log"))
    assert len(reports) == 4 and all(r.stat().st_mtime >= between for r in reports)  # ran again
    assert first["n"] == second["n"] == 4
    assert first["rewards"] == second["rewards"]
    again = json.loads((run_dir / "eval.json").read_text())["results"]
    assert [r["rewards"] for r in again] == [r["rewards"] for r in recorded]
    # what the harness did: its final workspace, every snapshot the evaluator took, its report
    assert any(name.endswith("stdout.log") for name in first_files)
    assert first_files.keys() == second_files.keys()
    assert [n for n in first_files if first_files[n] != second_files[n]] == []
