"""Codex CLI through the `codex` adapter: the runner, the proxy and the evaluator, for real.

Needs the `codex` binary (npm package @openai/codex; `tools/install_codex.sh` installs it
under .tools/). A scripted policy solves the `add` task with one `exec_command` call, so
the test shows the whole path a run uses: the launcher points Codex at the proxy from the
runner's environment (HOME inside the workspace, this execution's key), Codex's calls form
one linear tree for this execution only, and the evaluator scores the solved workspace 1.0.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gyre.harness import get_adapter
from gyre.harness.codex import find_codex
from gyre.proxy.config import Config
from gyre.tasks import Evaluator
from gyre.vocabulary import Outcome, VerdictStatus

pytestmark = pytest.mark.skipif(
    find_codex() is None, reason="the `codex` binary is absent: run tools/install_codex.sh"
)
MODEL = "codex-gyre-tiny"
SOLVE = "printf 'def add(a, b):\\n    return a + b\\n' > calc.py"


def _call(name: str, args: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_codex_solves_a_task_through_the_adapter(suite, run_scripted_harness) -> None:
    task = suite["add"]
    replies = [_call("exec_command", {"cmd": SOLVE}), "calc.py now adds."]
    config = Config(model_names=[MODEL], max_context_tokens=65536)
    run = run_scripted_harness(get_adapter("codex"), task, replies, config)
    term, tree, other = run.term, run.tree, run.other
    err = Path(term.stderr_path).read_text()
    assert term.outcome is Outcome.COMPLETED, f"{term.reason}; stderr: {err[-1500:]}"
    assert "calc.py now adds." in Path(term.stdout_path).read_text()
    assert [n.parent_id for n in tree.nodes] == [0, 1] and len(other) == 0
    home = Path(term.workspace) / ".gyre_home"
    assert (home / ".codex" / "config.toml").exists()  # HOME stayed inside the workspace
    verdict = asyncio.run(Evaluator().assess(term, task))
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 1.0
