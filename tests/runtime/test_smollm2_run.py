"""The real-model template, `templates/smollm2.yaml`, through the whole loop a user runs.

Shrunk for CI (two cells, groups of two, one short turn per execution), but otherwise the
template: SmolLM2-135M-Instruct with its real tokenizer, chat template and tool calls,
trained on the learnable `sum` task. It checks what a user of the real model relies on:

* `gyre run` completes its steps: the core publishes each update into the engines, saves
  the Hugging Face policy directories, and ends with a checkpoint of its last update (that
  a finished run continues from it is checked on the tiny model, test_kill_matrix.py);
* the final policy is a plain de-quantized model: transformers loads it and
  `gyre engine --model DIR` serves it;
* `gyre eval` scores it on held-out instances and `gyre report` renders the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gyre.trajectory.store import TraceReader

from .conftest import ROOT, final_policy_loads_and_serves

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.smollm2]


def _gyre(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gyre", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_smollm2_template_publishes_checkpoints_evaluates_and_reports(
    tmp_path: Path, smollm2_policy: object
) -> None:
    # smollm2_policy: the session's first SmolLM2 load, which keeps the converted model in
    # the cache, so this run's processes read it instead of de-quantizing it each
    cfg = yaml.safe_load((ROOT / "templates" / "smollm2.yaml").read_text())
    cfg["runs_dir"] = str(tmp_path / "runs")
    cfg["topology"]["cells"] = 2
    cfg["schedule"].update(group_size=2, batch_groups=1, concurrency_per_cell=2)
    cfg["harness"]["params"].update(max_turns="1", max_tokens="48")
    cfg["train"]["token_budget"] = 2048
    cfg["timeouts"].update(stall_s=240, run_s=600, drain_s=120)
    config = tmp_path / "smollm2.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"

    first = _gyre("run", str(config), "--steps", "2", "--run-dir", str(run_dir), "--quiet")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    state = json.loads((run_dir / "checkpoints" / "v00002" / "state.json").read_text())
    assert state["updates"] == 2 and state["version"] == 2, state  # the last update's

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["harness_errors"] == 0, summary
    with TraceReader(run_dir / "trace.h5") as r:
        events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
        rewards = r.rows("rewards")
    # the job publishes every update but its last into the engines: here v1, taken by all
    assert [(d["version"], d["missed"]) for k, d in events if k == "publish"] == [(1, [])]
    assert rewards and all(0.0 <= row["reward"] <= 1.0 for row in rewards if row["valid"])

    final_policy_loads_and_serves(run_dir / "policies" / "final", version=2)

    ev = _gyre("eval", str(run_dir), "--instances", "2", "--json")
    assert ev.returncode == 0, ev.stderr[-4000:]
    scored = json.loads(ev.stdout.strip().splitlines()[-1])
    assert scored["version"] == 2 and scored["n"] == 2 and scored["excluded"] == 0, scored

    rep = _gyre("report", str(run_dir), timeout=180)
    assert rep.returncode == 0, rep.stderr[-4000:]
    assert (run_dir / "report" / "index.html").stat().st_size > 0
