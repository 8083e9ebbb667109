"""Validation while training (`eval.every_steps`, issue 52 item 3) and the report it feeds.

The session's shared `learning_run` (tests/worlds.py `learning_world`: the default job, 40
steps, an evaluation every 20 of 2 held-out instances, one sample each, TensorBoard on; the
run tests/runtime/test_learning.py checks learns) checks what a researcher relies on:

* held-out points at steps 0, 20 and 40 — in `summary.json` `evals`, the trace's `eval/*`
  step rows and `eval` events, TensorBoard's `eval/reward_mean` — each on the policy of its
  step (the last one on the final policy), its sample transcript recorded;
* no evaluation execution is in the trace's executions, groups or rewards, nor admitted to a
  batch: evaluation never trains;
* `gyre report`'s page names the model, lr and commit, shows the config, the in-run held-out
  table, the new step-metric panels (metrics.png) and the samples.

The config keys' errors are one line each, before any process starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from worlds import EVAL_EVERY, LEARNING_STEPS, Learned

from gyre.errors import ConfigError
from gyre.runtime.shared.config import load_run_config
from gyre.trajectory.store import TraceReader

from .conftest import ROOT

STEPS, EVERY = LEARNING_STEPS, EVAL_EVERY
DUE = list(range(0, STEPS + 1, EVERY))  # 0, 20, 40


@pytest.fixture
def run(learning_run: Learned) -> Path:
    out = learning_run.run
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return learning_run.run_dir


@pytest.mark.mpi
@pytest.mark.slow
def test_held_out_points_during_training_never_train(run: Path, learning_run: Learned) -> None:
    from test_tracking import tensorboard_scalars

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    points = summary["evals"]
    assert [p["step"] for p in points] == DUE
    for p in points:  # each on its step's policy; both instances scored
        assert p["scored"] + p["excluded"] == 2 and min(p["versions"]) >= p["step"], p
    assert points[-1]["versions"] == [STEPS]  # the last one on the final policy

    with TraceReader(run / "trace.h5") as r:
        steps = r.rows("steps")
        events = r.rows("events")
        executions = [i.execution_id for i in r.executions()]
        groups = r.rows("groups")
        rewards = r.rows("rewards")
    curve = {int(s["step"]): s["value"] for s in steps if s["name"] == "eval/reward_mean"}
    assert sorted(curve) == DUE
    assert curve == pytest.approx({p["step"]: p["reward_mean"] for p in points})
    evals = [json.loads(e["detail"]) for e in events if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == DUE
    assert all(len(e["samples"]) == 1 and len(e["rewards"]) == 2 for e in evals)
    sample = next(iter(evals[0]["samples"].values()))
    assert sample["calls"] >= 1 and sample["messages"], sample

    # evaluation never trains: none of its executions is in the run's ledger or a batch
    evaluated = {x for e in evals for x in e["rewards"]}
    assert evaluated and all(x.startswith("eval-") for x in evaluated)
    trained = {g["execution_id"] for g in groups} | {r["execution_id"] for r in rewards}
    assert not evaluated & (trained | set(executions))
    assert not any(x.startswith("eval-") for x in trained | set(executions))
    admitted = {json.loads(e["detail"])["group"] for e in events if e["kind"] == "admit"}
    assert admitted and all(g.startswith("g") for g in admitted)

    scalars = tensorboard_scalars(learning_run.tensorboard)  # as the run wrote them
    assert scalars["eval/reward_mean"] == pytest.approx(curve)


class _Page(HTMLParser):
    """The report's header cells (by class), image sources, sample and table rows."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, str] = {}
        self.images: list[str] = []
        self.samples = 0
        self.in_run_rows = 0
        self._cell: str | None = None
        self._table: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "td" and self._table == "header":
            self._cell = a.get("class")
        elif tag == "table":
            self._table = a.get("class")
        elif tag == "img":
            self.images.append(a["src"] or "")
        elif tag == "details" and a.get("class") == "sample":
            self.samples += 1
        elif tag == "tr" and self._table == "in-run":
            self.in_run_rows += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell:
            self.cells[self._cell] = self.cells.get(self._cell, "") + data


@pytest.mark.mpi
@pytest.mark.slow
def test_report_names_what_ran_and_shows_the_curves(run: Path) -> None:
    rep = subprocess.run([sys.executable, "-m", "gyre", "report", str(run)],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    html = (run / "report" / "index.html").read_text()
    page = _Page()
    page.feed(html)
    with TraceReader(run / "trace.h5") as r:
        commit = r.run_meta["git_commit"]
    assert page.cells["model"] == "tiny" and page.cells["lr"] == "0.001 (constant)"
    assert page.cells["commit"] == commit and len(commit) >= 40
    assert "<details class='config'>" in html and "model_name: gyre-tiny" in html
    assert {"steps.png", "metrics.png", "timeline.png"} <= set(page.images)
    for name in ("steps.png", "metrics.png"):
        assert (run / "report" / name).stat().st_size > 10_000
    assert page.in_run_rows == 1 + len(DUE)  # head + one row per evaluation
    assert page.samples == len(DUE)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.every_steps=-1"], r"^run\.eval\.every_steps: -1; allowed: an integer >= 0$"),
        (["eval.every_steps=ten"], r"^run\.eval\.every_steps: expected an integer"),
        (["eval.instances=0"], r"^run\.eval\.instances: 0; allowed: an integer >= 1$"),
        (["eval.concurrency=0"], r"^run\.eval\.concurrency: 0; allowed: an integer >= 1$"),
        (["eval.every_steps=2", "eval.instances=2", "eval.log_samples=3"],
         r"^run\.eval\.log_samples: 3; allowed: at most eval\.instances \(2\)$"),
        (["eval.log_samples=1"],
         r"^run\.eval\.log_samples: 1 with every_steps 0; allowed: 0, or eval\.every_steps >= 1"),
        (["eval.every_stesp=2"], r"^run\.eval: unknown key 'every_stesp'.*every_steps"),
    ],
)  # fmt: skip
def test_eval_config_errors_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        load_run_config(ROOT / "templates" / "local.yaml", overrides)
    assert "\n" not in str(e.value)


def test_validation_needs_a_held_out_set_before_the_run_starts(tmp_path: Path) -> None:
    """A training suite whose task has no variables has no held-out seeds: refused by the
    preflight (one line), like `gyre eval`'s refusal, before any process starts."""
    from gyre.runtime.preflight import preflight
    from gyre.runtime.shared.checks import Where

    cfg = load_run_config(ROOT / "templates" / "local.yaml",
                          ["eval.every_steps=10", "harness.suite=builtin", "harness.tasks=[add]"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^eval\.every_steps: 10 needs a held-out set: .*add"):
        preflight(cfg, Where.HERE, run_dir=tmp_path / "run")
    fine = load_run_config(ROOT / "templates" / "local.yaml", ["eval.every_steps=10"])
    preflight(fine, Where.HERE, run_dir=tmp_path / "run")
