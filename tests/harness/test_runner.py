"""The harness runner against real subprocesses: budgets, process-group kills, cancellation,
bad input, events, and partial scoring of what a killed harness left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from gyre.errors import ConfigError, HarnessError
from gyre.harness import Adapter, ExecutionSpec, HarnessRunner, Launched, Terminated
from gyre.tasks import Evaluator, ToolLatency, Validity
from gyre.vocabulary import Outcome, VerdictStatus


def alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_pids(path: Path, n: int, timeout: float = 10.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) >= n:
                return pids
        time.sleep(0.05)
    raise AssertionError(f"{path} never listed {n} pids")


# Writes a partial solution (add works, nothing else), then spawns a background child that
# ignores SIGTERM and a grandchild, records their pids, and hangs.
PARTIAL_THEN_HANG = r"""
printf 'def add(a, b):\n    if isinstance(a, float):\n        return 0\n    return a + b\n' > calc.py
(trap '' TERM; sleep 300) & echo $! >> pids.txt
(sleep 300 & echo $! >> pids.txt; wait) &
echo $$ >> pids.txt
sleep 300
"""


def test_timeout_kills_the_whole_group_and_partial_work_is_scored(make_runner, spec_for, suite):
    runner = make_runner(harness_timeout_s=1.5)
    t0 = time.time()
    term = asyncio.run(runner.run(spec_for(PARTIAL_THEN_HANG)))
    assert term.outcome is Outcome.TIMED_OUT and "time budget of 1.5s" in term.reason
    assert 1.5 <= time.time() - t0 < 6
    pids = wait_pids(Path(term.workspace) / "pids.txt", 3)
    assert not any(alive(p) for p in pids)  # the TERM-ignoring child was SIGKILLed too
    assert [type(e) for e in runner.events] == [Launched, Terminated]
    assert runner.events[1] == term and term.assessable
    verdict = asyncio.run(Evaluator().assess(term, suite["add"]))
    assert verdict.status is VerdictStatus.SCORED and verdict.assessment.validity is Validity.VALID
    assert verdict.reward == pytest.approx(2 / 3)  # partial credit for partial work


def test_completed_harness_and_its_leftovers(make_runner, spec_for):
    runner = make_runner()
    script = "(sleep 300 & echo $! > bg.txt); echo hello; echo oops >&2"
    term = asyncio.run(runner.run(spec_for(script)))
    assert term.outcome is Outcome.COMPLETED and term.returncode == 0 and term.reason == ""
    assert Path(term.stdout_path).read_text() == "hello\n"
    assert Path(term.stderr_path).read_text() == "oops\n"
    assert not alive(wait_pids(Path(term.workspace) / "bg.txt", 1)[0])
    assert runner.running == []


def test_failing_harness_reports_status_and_stderr(make_runner, spec_for):
    term = asyncio.run(make_runner().run(spec_for("echo 'model unreachable' >&2; exit 7")))
    assert term.outcome is Outcome.FAILED and term.returncode == 7
    assert "exited with status 7" in term.reason and "model unreachable" in term.reason
    assert term.assessable  # it ran: whatever it left is scored


async def started(runner: HarnessRunner, spec: ExecutionSpec, marker: str) -> asyncio.Task:
    """The task running `spec`, once its harness has written `marker` in its workspace."""
    task = asyncio.create_task(runner.run(spec))
    while not runner.events or not Path(runner.events[0].workspace, marker).exists():
        await asyncio.sleep(0.02)
    return task


def test_cancel_kills_the_group(make_runner, spec_for):
    runner = make_runner()

    async def scenario():
        spec = spec_for("sleep 300 & echo $! > bg.tmp; mv bg.tmp bg.txt; wait")
        task = await started(runner, spec, "bg.txt")
        assert runner.running == ["e0"]
        assert runner.cancel("e0", "group already complete")
        assert not runner.cancel("other")
        return await task

    term = asyncio.run(scenario())
    assert term.outcome is Outcome.CANCELLED and term.reason == "group already complete"
    assert not alive(wait_pids(Path(term.workspace) / "bg.txt", 1)[0])


def test_cancelling_the_run_task_still_reports_and_kills(make_runner, spec_for):
    runner = make_runner()

    async def scenario():
        spec = spec_for("echo $$ > me.tmp; mv me.tmp me.txt; sleep 300")
        task = await started(runner, spec, "me.txt")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    launched, terminated = runner.events
    assert terminated.outcome is Outcome.CANCELLED
    assert not alive(wait_pids(Path(launched.workspace) / "me.txt", 1)[0])


def test_command_not_found_fails_cleanly(make_runner, spec_for, suite):
    missing = Adapter(
        name="ghost",
        api="anthropic",
        command=["no-such-harness", "-p", "{instruction}"],
        params={"script": ""},
        install="apt-get install ghost",
    )
    runner = make_runner()
    term = asyncio.run(runner.run(spec_for("", adapter=missing)))
    assert term.outcome is Outcome.FAILED and term.returncode is None and not term.assessable
    assert "'no-such-harness' not found" in term.reason and "apt-get install ghost" in term.reason
    assert [type(e) for e in runner.events] == [Terminated]
    verdict = asyncio.run(Evaluator().assess(term, suite["add"]))
    assert verdict.status is VerdictStatus.PLACEHOLDER and verdict.reward == 0.0
    # nothing else disturbed: the runner serves the next execution normally
    ok = asyncio.run(runner.run(spec_for("true", execution_id="e1")))
    assert ok.outcome is Outcome.COMPLETED


def test_setup_failure_yields_the_placeholder(make_runner, spec_for, suite, tmp_path):
    gone = dataclasses.replace(suite["add"], workspace=tmp_path / "deleted-after-load")
    term = asyncio.run(make_runner().run(spec_for("true", task_obj=gone)))
    assert term.outcome is Outcome.FAILED and term.reason.startswith("setup failed:")
    assert "initial state" in term.reason and term.workspace is None and not term.assessable
    verdict = asyncio.run(Evaluator().assess(term, gone))
    assert verdict.status is VerdictStatus.PLACEHOLDER and verdict.reward == 0.0


def test_bad_execution_ids_and_duplicates(make_runner, spec_for):
    runner = make_runner()
    bad = asyncio.run(runner.run(spec_for("true", execution_id="../escape")))
    assert bad.outcome is Outcome.FAILED and "execution id '../escape' is not allowed" in bad.reason
    first = asyncio.run(runner.run(spec_for("true", execution_id="dup")))
    second = asyncio.run(runner.run(spec_for("true", execution_id="dup")))
    assert first.outcome is Outcome.COMPLETED
    assert second.outcome is Outcome.FAILED and "already exists" in second.reason
    assert Path(first.workspace).is_dir()  # the first execution's workspace is untouched


def test_unknown_adapter_parameter_fails_the_execution(make_runner, spec_for):
    spec = dataclasses.replace(spec_for("true"), params={"scirpt": "true"})
    term = asyncio.run(make_runner().run(spec))
    assert term.outcome is Outcome.FAILED and "unknown parameter 'scirpt'" in term.reason


def test_runner_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="overall_timeout_s: 5 must be >= harness_timeout_s"):
        HarnessRunner.Config(
            workspace_root=str(tmp_path), harness_timeout_s=10, overall_timeout_s=5
        )
    with pytest.raises(ConfigError, match="sandbox"):
        from gyre.config import load

        load(HarnessRunner.Config, {"workspace_root": "x", "sandbox": "docker"})


def test_feedback_only_for_running_executions(make_runner, spec_for):
    runner = make_runner()

    async def scenario():
        task = asyncio.create_task(runner.run(spec_for("sleep 0.5; cat ../feedback.jsonl")))
        while not runner.events:
            await asyncio.sleep(0.02)
        runner.send_feedback("e0", "2/3 checks pass")
        return await task

    term = asyncio.run(scenario())
    assert '{"text": "2/3 checks pass"}' in Path(term.stdout_path).read_text()
    with pytest.raises(HarnessError, match="not running"):
        runner.send_feedback("e0", "late")


def test_workspace_is_a_fresh_copy(make_runner, spec_for, suite):
    runner = make_runner()
    t1 = asyncio.run(runner.run(spec_for("echo changed > calc.py", execution_id="a")))
    t2 = asyncio.run(runner.run(spec_for("cat calc.py", execution_id="b")))
    assert Path(t1.workspace, "calc.py").read_text() == "changed\n"
    assert Path(t2.stdout_path).read_text() == (suite["add"].workspace / "calc.py").read_text()
    assert (suite["add"].workspace / "calc.py").read_text() != "changed\n"
    assert os.path.commonpath([t1.workspace, t2.workspace]) == str(Path(runner.root))


def test_cancel_before_launch_still_reports_exactly_one_termination(make_runner, spec_for):
    runner = make_runner()

    async def scenario():
        task = asyncio.create_task(runner.run(spec_for("sleep 300")))
        await asyncio.sleep(0)  # the run is now preparing the workspace in a thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert [type(e) for e in runner.events] == [Terminated]
    assert runner.events[0].outcome is Outcome.CANCELLED and not runner.events[0].assessable
    assert runner.running == []


def test_a_harness_waits_its_querys_and_its_own_latency_factor(make_runner, spec_for, suite):
    """The runner gives each execution the task's tool latency with the execution's factors
    drawn: a group's executions (one task instance) share the query's, a hard query's
    executions are all slow together, and every execution has its own spread."""
    base = ToolLatency(dist="fixed", seconds=0.5, max_s=60, query_sigma=0.2,
                       hard_query_prob=0.5, hard_query_factor=8.0, execution_sigma=0.1)  # fmt: skip
    task = dataclasses.replace(suite["add"], tool_latency=base)
    adapter = Adapter(name="sh", api="openai", command=["bash", "-c", "{script}"],
                      params={"script": "true"}, applies_tool_latency=True)  # fmt: skip
    runner = make_runner()
    seconds: dict[tuple[int, int], float] = {}
    for instance in (3, 4, 5, 6):
        for e in range(2):
            eid = f"i{instance}-e{e}"
            spec = spec_for('echo "$GYRE_TOOL_LATENCY" > latency.json', execution_id=eid,
                            task_obj=task.instantiate(instance), adapter=adapter)  # fmt: skip
            term = asyncio.run(runner.run(spec))
            got = json.loads((Path(term.workspace) / "latency.json").read_text())
            query = f"{task.suite}/add/{instance}"
            assert got["seconds"] == pytest.approx(0.5 * base.factor(query, eid))
            assert got["hard_query_prob"] == 0.0  # drawn once, here: nothing left to draw
            seconds[instance, e] = got["seconds"]
    ratios = [seconds[i, 0] / seconds[i, 1] for i in (3, 4, 5, 6)]
    assert all(0.5 < r < 2 for r in ratios)  # a group: the same query, a small spread
    assert len({round(s, 9) for s in seconds.values()}) == 8  # but each its own
