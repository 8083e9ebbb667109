"""The reference agent with a real small model (SmolLM2-135M-Instruct) behind the proxy.

Same configuration as the tiny-model test (forced delegation and compaction), on a model
that reads the instruction: the tree must branch the same way and the workspace is scored.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gyre.harness import ExecutionSpec, HarnessRunner, get_adapter
from gyre.models import load_tokenizer
from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.tasks import Evaluator, Validity, snapshot_id
from gyre.vocabulary import Outcome

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
MODEL = "smollm2"


def test_smollm2_reference_agent_branches_and_is_scored(tmp_path, suite, smollm2_url):
    task = suite["add"]
    params = {
        "max_turns": "2", "max_tokens": "48", "compact_at": "1", "summary_tokens": "32",
        "delegate": "force", "subagent_turns": "1", "tool_choice": "required", "temperature": "0.7",
    }  # fmt: skip
    tok = load_tokenizer("smollm2-135m")
    with running_proxy({"e0": smollm2_url}, tokenizer=tok, config=Config(model_names=[MODEL])) as p:
        key = p.admin("/admin/executions", {"execution_id": "smol", "role": "main"})["key"]
        runner = HarnessRunner(
            HarnessRunner.Config(
                workspace_root=str(tmp_path / "ws"),
                harness_timeout_s=400,
                overall_timeout_s=500,
            )
        )
        spec = ExecutionSpec(
            execution_id="smol", task=task, adapter=get_adapter("reference"),
            proxy_url=p.url, api_key=key, model=MODEL, params=params,
        )  # fmt: skip
        term = asyncio.run(runner.run(spec))
        tree = p.call(p.app.tree, "smol")
    assert term.outcome is Outcome.COMPLETED, Path(term.stderr_path).read_text()[-2000:]
    roles = {n.role for n in tree.nodes}
    assert {"main", "subagent", "compaction"} <= roles and len(tree.leaves()) >= 3
    verdict = asyncio.run(Evaluator().assess(term, task))
    assert verdict.assessment.validity is Validity.VALID
    assert verdict.assessment.state_ref == snapshot_id(term.workspace)
