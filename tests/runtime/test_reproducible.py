"""A run's sampling follows its seed: `gyre eval` of one policy twice gives the same result.

Every sampled call's seed derives from `train.seed`, the execution and the call index
(`gyre.proxy.service.call_seed`), so the same policy on the same held-out instances makes
the same calls, the harness does the same things and the evaluator gives the same rewards,
whatever order the engine batches the calls in. (Unseeded, two evaluations of the tiny model
differed in rewards, agent reports and workspaces.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _eval(out: Path) -> tuple[dict, dict[str, bytes]]:
    proc = subprocess.run(
        [sys.executable, "-m", "gyre", "eval", "tiny", "--instances", "4", "--json",
         "--out", str(out)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    root = out / "tiny" / "workspaces"
    files = {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "stderr.log"  # stderr: library warnings, not behaviour
    }
    return result, files


@pytest.mark.slow
def test_gyre_eval_twice_gives_identical_executions(tmp_path: Path) -> None:
    first, first_files = _eval(tmp_path / "a")
    second, second_files = _eval(tmp_path / "b")
    assert first["n"] == second["n"] == 4
    assert first["rewards"] == second["rewards"]
    # what the harness did: its final workspace, every snapshot the evaluator took, its report
    assert any(name.endswith("stdout.log") for name in first_files)
    assert first_files.keys() == second_files.keys()
    assert [n for n in first_files if first_files[n] != second_files[n]] == []
