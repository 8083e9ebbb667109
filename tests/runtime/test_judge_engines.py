"""A run whose reward comes from a judge served by an engine in the job (issue 52 item 1):
`topology.judge_engines: 1`, a task scored by `rule: judge` with no endpoint, the tiny model as
the judge (its answer constrained to the verdict schema, so it parses). Checked: every
assessment in the trace carries the judge's critique and score, the judge engine's URL is in
the summary and never among a publication's targets, a judge engine SIGKILLed mid-run is
started again (one run, `judged_run`, read by both), and a run with no judge to ask is refused
at preflight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre.errors import ConfigError
from gyre.runtime.preflight import preflight
from gyre.runtime.shared.checks import Where
from gyre.runtime.shared.config import load_run_config
from gyre.tasks.suite import LEARN_DIR
from gyre.trajectory.store import TraceReader
from runtime.conftest import small_config, write_config


def _judged_config(tmp_path: Path, judges: int, endpoint: str | None = None) -> Path:
    notes = LEARN_DIR / "notes"
    rubric = tmp_path / "hidden" / "rubric.md"
    rubric.parent.mkdir()
    rubric.write_text("1 if the directory holds one markdown bullet file per note, else 0.\n")
    # max_tokens 600: the tiny judge's critique, a random string, outran 200 tokens in ~2 of
    # 3 verdicts, each then asked again after a back-off of up to 5 s (the judged run took
    # 45-80 s, its 6 steps ~60 s of it; with 600, 11-15 s)
    suite = {"name": "judged", "tasks": [{
        "name": "notes", "instruction": "Take notes on bugs: one file per note.",
        "workspace": str(notes / "workspace"),
        "scoring": {"rule": "judge", "rubric": str(rubric), "timeout_s": 30,
                    "judge": {"max_tokens": 600, "temperature": 1.0, "max_input_chars": 2000}},
    }]}  # fmt: skip
    if endpoint:
        suite["tasks"][0]["scoring"]["judge"].update(endpoint=endpoint, model="judge")
    (tmp_path / "suite.yaml").write_text(json.dumps(suite))
    cfg = small_config(tmp_path, topology={"cells": 1, "judge_engines": judges})
    cfg["harness"].update(suite=str(tmp_path / "suite.yaml"), tasks=["notes"])
    cfg["harness"]["params"].update({"max_turns": "1", "max_tokens": "16"})
    cfg["schedule"].update(group_size=2, batch_groups=1, concurrency_per_cell=2)
    return write_config(tmp_path, cfg)


def test_a_judge_without_endpoint_or_engine_is_refused(tmp_path: Path) -> None:
    cfg = load_run_config(_judged_config(tmp_path, judges=0))
    with pytest.raises(ConfigError, match=r"topology\.judge_engines.*scoring\.judge\.endpoint"):
        preflight(cfg, Where.ANYWHERE)


@dataclass(frozen=True)
class Judged:
    run_dir: Path
    returncode: int
    output: str


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory: pytest.TempPathFactory) -> Judged:
    """One judged `gyre run` (6 steps, a judge engine on its own rank) whose judge engine is
    SIGKILLed once the run makes progress; read by both tests below (one xdist worker:
    tests/conftest.py)."""
    import signal
    import time

    from processes import child_of, wait_for

    tmp_path = tmp_path_factory.mktemp("judged")
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "gyre", "run", str(_judged_config(tmp_path, judges=1)),
         "--run-dir", str(run_dir), "--quiet", "--steps", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        judge_rank = wait_for(run_dir, "rank", 3, timeout=120)  # coordinator, proxy, cell, judge
        deadline = time.monotonic() + 120
        while not (engine := child_of(judge_rank.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine, "the judge rank started no engine"
        log = run_dir / "job.log"  # progress begins once every engine, the judge's too, serves
        while "GYRE-PROGRESS" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.1)
        os.kill(engine, signal.SIGKILL)
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return Judged(run_dir, job.returncode, output[-4000:])


@pytest.mark.mpi
@pytest.mark.slow
def test_judge_engine_scores_the_run_and_is_never_published_to(judged_run: Judged) -> None:
    """Every valid assessment is the judge's verdict (a score and its critique); no
    publication targets the judge engine, neither as first started nor as started again."""
    assert judged_run.returncode == 0, judged_run.output
    run_dir = judged_run.run_dir
    with TraceReader(run_dir / "trace.h5") as r:
        assessments = r.rows("assessments")
        events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
    valid = [a for a in assessments if a["valid"]]
    assert valid, assessments
    for a in valid:  # the verdict, parsed: a score in [0, 1] and the judge's critique
        assert 0.0 <= a["score"] <= 1.0 and isinstance(a["critique"], str), a
        assert json.loads(a["detail"])["validity"] == "valid"
    judges = [d["url"] for k, d in events if k in ("judge_ready", "judge_restarted")]
    assert [d["judge"] for k, d in events if k == "judge_ready"] == [0] and len(judges) == 2
    published = [d for k, d in events if k == "publish"]
    assert published and all(not set(judges) & set(d["urls"]) for d in published), published
    assert (run_dir / "logs" / "engine-judge0.log").exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_a_run_whose_judge_endpoint_is_down_scores_nothing_zero(tmp_path: Path) -> None:
    """The judge's endpoint refuses every connection: each execution's evaluation is retried
    within the evaluator's budget, every attempt recorded unresolved with the reason, none
    scored (no reward of 0 enters training), the steps skip their updates, and the run
    still finishes (its closing drain gives up on evaluations still retrying)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    config = _judged_config(tmp_path, judges=0, endpoint=f"http://127.0.0.1:{port}/v1")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", str(config), "--run-dir", str(run_dir), "--quiet",
         "--steps", "1", "timeouts.drain_s=1", "harness.eval_attempts=3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    with TraceReader(run_dir / "trace.h5") as r:
        assessments = r.rows("assessments")
        events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
    assert assessments and not any(a["valid"] for a in assessments), assessments
    for a in assessments:
        detail = json.loads(a["detail"])
        assert detail["validity"] == "unresolved" and "unreachable" in detail["error"], detail
    attempts: dict[str, int] = {}
    for a in assessments:
        attempts[a["execution_id"]] = max(attempts.get(a["execution_id"], 0), a["attempt"])
    assert set(attempts.values()) == {3}, attempts  # retried to harness.eval_attempts
    assert [d["step"] for k, d in events if k == "empty_step"] == [1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 1 and summary["empty_steps"] == 1


@pytest.mark.mpi
@pytest.mark.slow
def test_a_judge_engine_killed_mid_run_is_started_again(judged_run: Judged) -> None:
    """SIGKILL the judge engine once it serves: its rank starts it again and reports the new
    URL, the proxy node's judge asks that one, verdicts made meanwhile are retried (never
    zero) and later ones are the judge's again; the run finishes."""
    assert judged_run.returncode == 0, judged_run.output
    run_dir = judged_run.run_dir
    with TraceReader(run_dir / "trace.h5") as r:
        events = [(e["kind"], e["t"], json.loads(e["detail"])) for e in r.rows("events")]
        assessments = r.rows("assessments")
    (first,) = [d["url"] for k, _, d in events if k == "judge_ready"]
    restarted = [(t, d["url"]) for k, t, d in events if k == "judge_restarted"]
    assert len(restarted) == 1 and restarted[0][1] != first, restarted
    assert json.loads((run_dir / "summary.json").read_text())["judge_engines"] == [restarted[0][1]]
    assert any(a["valid"] and a["t"] > restarted[0][0] for a in assessments), assessments
