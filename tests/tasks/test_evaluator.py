"""The evaluator (paper §5.2): valid scores, retries on one preserved state, exclusion,
placeholders, and an append-only assessment record."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import shutil
import sys
import time

import pytest

from gyre.errors import ConfigError
from gyre.tasks import AssessmentLog, Evaluator, Validity, feedback_text
from gyre.tasks.snapshot import snapshot_id
from gyre.tasks.suite import ScoringConfig
from gyre.vocabulary import Outcome, VerdictStatus

# Fails on its first `fails` runs (counted in a file outside the workspace), then scores
# the fraction of lines of answer.txt that read "ok". On its first run it also scribbles on
# the *live* workspace given as argv[3], which a correct evaluator never assesses.
FLAKY = """
import pathlib, sys
counter, fails, live = pathlib.Path(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
if n == 0:
    (live / "answer.txt").write_text("ok\\nok\\nok\\nok\\n")
if n < fails:
    raise SystemExit(f"scorer crashed (run {n})")
lines = pathlib.Path("answer.txt").read_text().split()
print(sum(x == "ok" for x in lines) / len(lines))
"""


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "exec" / "workspace"
    ws.mkdir(parents=True)
    (ws / "answer.txt").write_text("ok\nno\nok\nno\n")
    return ws


def flaky_task(suite, tmp_path, ws, fails: int):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    argv = [sys.executable, str(script), str(tmp_path / "count"), str(fails), str(ws)]
    return dataclasses.replace(
        suite["add"], scoring=ScoringConfig(rule="command", command=argv, timeout_s=10)
    )


def test_evaluator_failing_twice_then_succeeding_gives_the_later_score(
    suite, tmp_path, workspace, make_terminated
):
    task = flaky_task(suite, tmp_path, workspace, fails=2)
    state = snapshot_id(workspace)
    ev = Evaluator(Evaluator.Config(retry_backoff_s=0.01))
    verdict = asyncio.run(ev.assess(make_terminated(workspace), task))
    assert (
        verdict.status is VerdictStatus.SCORED and verdict.reward == 0.5 and verdict.attempts == 3
    )
    history = ev.log.for_execution("e0")
    assert [a.validity for a in history] == [
        Validity.UNRESOLVED,
        Validity.UNRESOLVED,
        Validity.VALID,
    ]
    assert [a.seq for a in history] == [0, 1, 2] and [a.attempt for a in history] == [1, 2, 3]
    # every attempt assessed the same preserved state, not the live workspace it scribbled on
    assert {a.state_ref for a in history} == {state}
    assert (workspace / "answer.txt").read_text() == "ok\nok\nok\nok\n"
    assert "scorer crashed (run 0)" in history[0].error and history[0].score is None


def test_evaluator_that_never_succeeds_is_unresolved_and_excluded(
    suite, tmp_path, workspace, make_terminated
):
    task = flaky_task(suite, tmp_path, workspace, fails=10**6)
    ev = Evaluator(Evaluator.Config(retry_backoff_s=0.05))
    t0 = time.time()
    verdict = asyncio.run(ev.assess(make_terminated(workspace, budget_s=1.5), task))
    assert time.time() - t0 < 4.0  # stops at the overall budget
    assert (
        verdict.status is VerdictStatus.EXCLUDED and verdict.reward is None and not verdict.usable
    )
    history = ev.log.for_execution("e0")
    assert len(history) >= 2 and all(a.validity is Validity.UNRESOLVED for a in history)
    assert all(a.score is None for a in history)  # never a zero


def test_retries_within_the_budget_pause_longer_each_time(
    suite, tmp_path, workspace, make_terminated
):
    """The paper's rule (no attempt cap): a failing scorer is retried until the overall budget
    runs out, after pauses that double from `retry_backoff_s` up to `max_backoff_s`."""
    ev = Evaluator(Evaluator.Config(retry_backoff_s=0.1, max_backoff_s=0.4))
    assert [ev.backoff(i) for i in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.4, 0.4]
    task = flaky_task(suite, tmp_path, workspace, fails=10**6)
    verdict = asyncio.run(ev.assess(make_terminated(workspace, budget_s=2.0), task))
    history = ev.log.for_execution("e0")
    assert verdict.status is VerdictStatus.EXCLUDED and verdict.attempts == len(history) >= 3
    for i, (a, b) in enumerate(itertools.pairwise(history), start=1):
        assert b.t_start - a.t_end >= ev.backoff(i) - 0.02, (i, b.t_start - a.t_end)


def test_max_attempts_bounds_retries(suite, tmp_path, workspace, make_terminated):
    task = flaky_task(suite, tmp_path, workspace, fails=10**6)
    ev = Evaluator(Evaluator.Config(retry_backoff_s=0.0, max_attempts=2))
    verdict = asyncio.run(ev.assess(make_terminated(workspace), task))
    assert verdict.status is VerdictStatus.EXCLUDED and verdict.attempts == 2


def test_budget_already_spent_excludes_without_scoring(suite, workspace, make_terminated):
    verdict = asyncio.run(Evaluator().assess(make_terminated(workspace, budget_s=-1), suite["add"]))
    assert (
        verdict.status is VerdictStatus.EXCLUDED
        and verdict.assessment.validity is Validity.UNRESOLVED
    )


def test_valid_zero_is_a_usable_reward(suite, tmp_path, make_terminated):
    ws = tmp_path / "workspace"
    shutil.copytree(suite["add"].workspace, ws)
    verdict = asyncio.run(
        Evaluator().assess(make_terminated(ws, outcome=Outcome.TIMED_OUT), suite["add"])
    )
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 0.0 and verdict.usable
    assert verdict.assessment.validity is Validity.VALID


def test_no_assessable_work_gets_a_zero_reward_placeholder(suite, tmp_path, make_terminated):
    ev = Evaluator()
    v1 = asyncio.run(ev.assess(make_terminated(None, assessable=False), suite["add"]))
    assert v1.status is VerdictStatus.PLACEHOLDER and v1.reward == 0.0 and v1.usable
    assert v1.assessment.validity is Validity.PLACEHOLDER and v1.assessment.state_ref is None
    gone = tmp_path / "vanished"
    v2 = asyncio.run(ev.assess(make_terminated(gone, execution_id="e1"), suite["add"]))
    assert (
        v2.status is VerdictStatus.PLACEHOLDER and "could not be preserved" in v2.assessment.error
    )


class Sink:
    def __init__(self):
        self.rows = []

    def append(self, table, rows):
        self.rows += [(table, r) for r in rows]


def test_assessments_accumulate_per_execution_and_state(
    suite, solutions, tmp_path, make_terminated
):
    task = suite["fizzbuzz"]
    ws = tmp_path / "exec" / "workspace"
    shutil.copytree(task.workspace, ws)
    sink = Sink()
    ev = Evaluator(log=AssessmentLog(sink))
    early = asyncio.run(ev.assess_intermediate("e0", ws, task))
    shutil.copytree(solutions / "fizzbuzz", ws, dirs_exist_ok=True)
    final = asyncio.run(ev.assess(make_terminated(ws), task)).assessment
    assert early.kind == "intermediate" and final.kind == "final"
    assert early.state_ref != final.state_ref and early.score < final.score == 1.0
    assert ev.log.for_execution("e0") == [early, final]  # the later one did not overwrite
    assert ev.log.for_state(early.state_ref) == [early]
    assert [(t, r["seq"], r["kind"]) for t, r in sink.rows] == [
        ("assessments", 0, "intermediate"),
        ("assessments", 1, "final"),
    ]
    assert (tmp_path / "exec" / "snapshots" / early.state_ref).is_dir()
    text = feedback_text(early)
    assert early.state_ref in text and "hidden checks pass" in text


def test_log_refuses_out_of_order_records(suite, workspace):
    log = AssessmentLog()
    a = asyncio.run(Evaluator(log=log).assess_intermediate("e0", workspace, suite["add"]))
    with pytest.raises(ValueError, match="expected 1"):
        log.record(a)


def test_evaluator_config_validation():
    with pytest.raises(ConfigError, match="retry_backoff_s"):
        Evaluator.Config(retry_backoff_s=-1)
    with pytest.raises(ConfigError, match="max_backoff_s"):
        Evaluator.Config(retry_backoff_s=1.0, max_backoff_s=0.5)
