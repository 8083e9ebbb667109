"""Claude Code (`claude -p`) as an unmodified black-box harness against the proxy.

Needs the `claude` binary (npm package @anthropic-ai/claude-code; `tools/install_claude.sh`
installs it under .tools/). The tiny engine's replies are random text, so Claude Code ends
after its first turn; the test checks the runner's environment works for it (offline,
HOME in the workspace, per-execution key) and that its calls were recorded as a tree for
the right execution and nobody else's (max_tokens continuations extend the recorded path).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gyre.harness import ExecutionSpec, HarnessRunner, get_adapter
from gyre.models import tiny_tokenizer
from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.rollout.testing import running_engine
from gyre.tasks import Evaluator, Validity
from gyre.vocabulary import Outcome

ADAPTER = get_adapter("claude_code_bare")
CLAUDE = ADAPTER.resolve_program(os.environ.get("PATH", ""))
pytestmark = pytest.mark.skipif(
    CLAUDE is None,
    reason="the `claude` binary is absent (not on PATH, not in .tools/node_modules/.bin): "
    "run tools/install_claude.sh",
)
MODEL = "claude-gyre-tiny"


def test_claude_code_calls_are_recorded_for_its_execution(tmp_path, suite):
    task = suite["reverse_words"]
    config = Config(model_names=[MODEL], max_tokens_cap=64, default_max_tokens=64)
    with (
        running_engine("tiny") as url,
        running_proxy({"e0": url}, tokenizer=tiny_tokenizer(), config=config) as p,
    ):
        key = p.admin("/admin/executions", {"execution_id": "cc-1", "role": "main"})["key"]
        p.admin("/admin/executions", {"execution_id": "cc-other"})
        runner = HarnessRunner(
            HarnessRunner.Config(
                workspace_root=str(tmp_path / "ws"), harness_timeout_s=180, overall_timeout_s=240
            )
        )
        spec = ExecutionSpec(
            execution_id="cc-1", task=task, adapter=ADAPTER, proxy_url=p.url, api_key=key,
            model=MODEL, params={"max_turns": "2"},
        )  # fmt: skip
        term = asyncio.run(runner.run(spec))
        tree = p.call(p.app.tree, "cc-1")
        other = p.call(p.app.tree, "cc-other")
    out = Path(term.stdout_path).read_text()
    err = Path(term.stderr_path).read_text()
    # random tiny-model text ends Claude Code's run (often as an error after max_tokens
    # continuations); what matters is that it launched, ran to its end and was recorded
    assert term.outcome in (Outcome.COMPLETED, Outcome.FAILED), term.reason
    assert term.returncode is not None and term.assessable
    assert '"type":"result"' in out and MODEL in out  # claude's own JSON result
    assert len(tree) >= 1, f"no call recorded; stdout: {out[-1000:]} stderr: {err[-1000:]}"
    assert len(other) == 0
    assert all(n.role == "main" for n in tree.nodes)
    for prev, node in zip(tree.nodes, tree.nodes[1:]):
        assert node.parent_id == prev.node_id  # one growing conversation: prefix shared
    first = tree.nodes[0]
    assert first.parent_id == 0 and len(first.input_ids) > 500  # system prompt + tool schemas
    home = Path(term.workspace) / ".gyre_home"
    assert (home / ".claude.json").exists() or (home / ".claude").is_dir()  # HOME stayed inside
    verdict = asyncio.run(Evaluator().assess(term, task))
    assert verdict.assessment.validity is Validity.VALID
