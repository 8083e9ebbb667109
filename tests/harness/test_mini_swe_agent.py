"""mini-swe-agent through the `mini_swe_agent` adapter: runner, proxy and evaluator, for real.

Needs mini-swe-agent in its own virtual environment (`tools/install_mini_swe_agent.sh`
installs it under .tools/). A scripted policy solves the `add` task with one bash call and
then submits (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`); mini-swe-agent talks to the
proxy's Chat Completions through litellm with the execution's key, its calls form one linear
tree for this execution only, and the evaluator scores the solved workspace 1.0.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from gyre.harness import get_adapter
from gyre.proxy.config import Config
from gyre.tasks import Evaluator
from gyre.vocabulary import Outcome, VerdictStatus

ADAPTER = get_adapter("mini_swe_agent")
pytestmark = pytest.mark.skipif(
    ADAPTER.resolve_program(os.environ.get("PATH", "")) is None,
    reason="mini-swe-agent is absent: run tools/install_mini_swe_agent.sh",
)
MODEL = "mini-gyre-tiny"
SOLVE = "printf 'def add(a, b):\\n    return a + b\\n' > calc.py"


def _bash(command: str) -> str:
    call = {"name": "bash", "arguments": {"command": command}}
    return f"Let me do it.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_mini_swe_agent_solves_a_task_through_the_adapter(suite, run_scripted_harness) -> None:
    task = suite["add"]
    replies = [_bash(SOLVE), _bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
    run = run_scripted_harness(ADAPTER, task, replies, Config(model_names=[MODEL]))
    term, tree, other = run.term, run.tree, run.other
    err = Path(term.stderr_path).read_text()
    assert term.outcome is Outcome.COMPLETED, f"{term.reason}; stderr: {err[-1500:]}"
    assert [n.parent_id for n in tree.nodes] == [0, 1] and len(other) == 0
    assert all(n.finish_reason == "tool_calls" for n in tree.nodes)
    verdict = asyncio.run(Evaluator().assess(term, task))
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 1.0
