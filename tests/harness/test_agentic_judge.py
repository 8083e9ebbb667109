"""The agentic judge: the reference agent runs as the evaluator in its own bwrap sandbox,
on a copy of the work with the hidden tests, and the verdict.json it writes is the score.

The judge's model is a scripted OpenAI-compatible stub on loopback (`openai_stub`): it reads
the hidden test the judge was given, then writes a verdict; the policy's own planted
verdict.json (score 1) is never read.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from openai_stub import openai_stub

from gyre.harness.events import Terminated
from gyre.harness.judge import VERDICT_FILE, HarnessJudge
from gyre.harness.sandbox import bwrap_available
from gyre.tasks import Evaluator, Validity
from gyre.tasks.judge import Judge
from gyre.tasks.suite import Task, load_suite
from gyre.vocabulary import Outcome, VerdictStatus

HIDDEN_TEST = (
    "def test_add():\n    from calc import add\n    assert add(2, 3) == 5  # HIDDEN-MARK\n"
)
VERDICT = {"score": 0.25, "critique": "add subtracts; test_add fails"}


def call(name: str, **arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c-{name}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}]}  # fmt: skip


def judge_agent(body: dict[str, Any], n: int) -> dict[str, Any]:
    """Read the hidden test, write the verdict, answer."""
    if n == 0:
        return call("read_file", path="test_add.py")
    if n == 1:
        return call("write_file", path=VERDICT_FILE, content=json.dumps(VERDICT))
    return {"role": "assistant", "content": "verdict written"}


def ended(workspace: Path) -> Terminated:
    """The judged execution's end, as the runner reports it."""
    now = time.time()
    return Terminated(
        execution_id="e0", outcome=Outcome.COMPLETED, reason="", returncode=0, t=now,
        t_launch=now - 1.0, deadline=now + 120, workspace=str(workspace), stdout_path=None,
        stderr_path=None, assessable=True,
    )  # fmt: skip


def agentic_task(tmp_path: Path, url: str) -> Task:
    root = tmp_path / "suite"
    ws = root / "add" / "workspace"
    ws.mkdir(parents=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (ws / VERDICT_FILE).write_text('{"score": 1, "critique": "planted by the policy"}')
    (root / "add" / "hidden").mkdir()
    (root / "add" / "hidden" / "rubric.md").write_text("Full marks when test_add passes.")
    (root / "add" / "hidden" / "test_add.py").write_text(HIDDEN_TEST)
    task = {"instruction": "Implement add(a, b) in calc.py.", "scoring": {
        "rule": "judge", "agentic": True, "rubric": "hidden/rubric.md",
        "tests": "hidden/test_add.py", "timeout_s": 60,
        "judge": {"endpoint": url, "model": "judge", "params": {"delegate": "off"}}}}  # fmt: skip
    (root / "add" / "task.yaml").write_text(json.dumps(task))
    return load_suite(root)["add"]


@pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (bwrap) not installed")
def test_the_agentic_judge_scores_in_its_sandbox_from_its_verdict_file(
    tmp_path: Path,
) -> None:
    with openai_stub(judge_agent) as (url, seen):
        task = agentic_task(tmp_path, url)
        ws = tmp_path / "exec" / "workspace"
        shutil.copytree(task.workspace, ws)
        ev = Evaluator(Evaluator.Config(max_attempts=1),
                       rules={"judge": Judge(agent=HarnessJudge("bwrap"))})  # fmt: skip
        verdict = asyncio.run(ev.assess(ended(ws), task))
    assert verdict.status is VerdictStatus.SCORED, ev.log.for_execution("e0")
    assert (verdict.reward, verdict.assessment.critique) == (VERDICT["score"], VERDICT["critique"])
    assert len(seen) == 3
    first = seen[0]["body"]["messages"]
    assert "Full marks when test_add passes." in json.dumps(first)  # the rubric, in its prompt
    tool_result = seen[1]["body"]["messages"][-1]
    assert tool_result["role"] == "tool" and "HIDDEN-MARK" in tool_result["content"]


@pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (bwrap) not installed")
def test_an_agentic_judge_that_writes_no_verdict_is_unresolved(
    tmp_path: Path,
) -> None:
    with openai_stub(lambda body, n: {"role": "assistant", "content": "looks fine"}) as (url, _):
        task = agentic_task(tmp_path, url)
        ev = Evaluator(Evaluator.Config(max_attempts=2, retry_backoff_s=0.01),
                       rules={"judge": Judge(agent=HarnessJudge("bwrap"))})  # fmt: skip
        verdict = asyncio.run(ev.assess(ended(task.workspace), task))
    assert verdict.status is VerdictStatus.EXCLUDED and verdict.reward is None
    attempts = ev.log.for_execution("e0")
    assert [a.validity for a in attempts] == [Validity.UNRESOLVED] * 2
    assert "wrote no verdict.json" in attempts[0].error
