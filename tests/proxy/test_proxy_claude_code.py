"""Real Claude Code (the npm package) as a client of the proxy, when it is installed.

`tools/install_claude.sh` installs it into `<repo>/.tools` (or set GYRE_CLAUDE_BIN). Claude
Code streams `POST /v1/messages?beta=true` with its own system blocks, tools and
system-reminder messages; with a tiny output cap every reply ends by length and Claude Code
asks the model to resume, so one execution records a linear chain whose every path equals
what the engine received.

With a scripted policy, the `claude_code` adapter's own command (its default tools include
the sub-agent tool, Agent) delegates to a sub-agent, then `/compact` compacts the session
and a resumed session answers: the proxy, configured as the runtime configures it (the
adapter's shipped role rules), records the calls as main / subagent / compaction, and
admission takes them in role priority order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, assert_paths_match, assert_paths_match_engine, harness_run_config

from gyre.harness import get_adapter
from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, ScriptedEngine, running_proxy
from gyre.runtime.proxy_node.node import proxy_config
from gyre.train.admission import AdmissionTree, admit, derive_seed

REPO = Path(__file__).resolve().parents[2]
CLAUDE = Path(os.environ.get("GYRE_CLAUDE_BIN", REPO / ".tools/node_modules/.bin/claude"))
DELEGATE = (
    '<tool_call>\n{"name": "Agent", "arguments": {"description": "Count files", "prompt": '
    '"Count the files here and report the number.", "subagent_type": "general-purpose", '
    '"run_in_background": false}}\n</tool_call>'
)
SUMMARY = "<analysis>Counted files.</analysis>\n<summary>A sub-agent counted 0 files.</summary>"


@pytest.mark.skipif(
    not CLAUDE.exists(), reason="Claude Code not installed (tools/install_claude.sh)"
)
def test_claude_code_session_is_one_linear_exact_path(
    engine_url: str, tokenizer: Any, tmp_path: Path
) -> None:
    config = Config(model_names=[MODEL], max_tokens_cap=16)
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "claude-1", "main")
        env = {
            **os.environ,
            "HOME": str(tmp_path),
            "ANTHROPIC_BASE_URL": p.url,
            "ANTHROPIC_API_KEY": key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
        run = subprocess.run(
            [
                str(CLAUDE),
                "-p",
                "List the files here.",
                "--output-format",
                "json",
                "--model",
                MODEL,
                "--max-turns",
                "3",
                "--tools",
                "Bash,Read",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        result = json.loads(run.stdout)
        assert result["num_turns"] >= 2, run.stderr[-2000:]
        tree = p.call(p.app.tree, "claude-1")
        assert len(tree) >= 2
        assert [n.parent_id for n in tree.nodes] == list(range(len(tree)))
        assert assert_paths_match_engine(p, "claude-1", engine_url) == len(tree)


def _claude(p: RunningProxy, key: str, home: Path, prompt: str, *extra: str) -> dict[str, Any]:
    """One `claude -p` run of the claude_code adapter's own command, against the proxy."""
    values = {"instruction": prompt, "model": MODEL}
    argv, env = get_adapter("claude_code").render(values, {"max_turns": "5"})
    env = {
        **os.environ, **env, "HOME": str(home), "ANTHROPIC_BASE_URL": p.url,
        "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_MAX_RETRIES": "0",
    }  # fmt: skip
    run = subprocess.run(
        [str(CLAUDE), *argv[1:], *extra], cwd=home, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return dict(json.loads(run.stdout))


@pytest.mark.skipif(
    not CLAUDE.exists(), reason="Claude Code not installed (tools/install_claude.sh)"
)
def test_claude_code_subagent_and_compaction_are_labelled_and_admitted_by_role(
    tokenizer: Any, tmp_path: Path
) -> None:
    run_cfg = harness_run_config("claude_code", 1_000_000)
    config = proxy_config(run_cfg)  # what the proxy node serves: the adapter's rules included
    script = [DELEGATE, "The sub-agent found 0 files.", "There are 0 files.", SUMMARY, "0."]
    engine = ScriptedEngine(tokenizer, script)
    eid = "claude-roles"
    with running_proxy({"e0": engine}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, eid, "main")
        first = _claude(p, key, tmp_path, "Count the files here with a sub-agent.")
        assert first["result"] == "There are 0 files."
        assert first["subagent_stats"]["completed"] == 1, first
        session = ["--resume", first["session_id"]]
        _claude(p, key, tmp_path, "/compact", *session)
        assert _claude(p, key, tmp_path, "How many files?", *session)["result"] == "0."
        tree = p.call(p.app.tree, eid)
        assert assert_paths_match(p, eid, engine.requests) == len(tree) == 5
    # main delegates; the sub-agent answers; main answers; /compact; the resumed session
    assert [n.role for n in tree.nodes] == ["main", "subagent", "main", "compaction", "main"]
    adm = AdmissionTree.from_tree(tree)
    assert len(adm.leaves()) == 4  # both main answers, the compaction, the sub-agent
    admission, seed = run_cfg.train.admission, derive_seed(run_cfg.train.seed, eid)
    every = admit(adm, config=admission, seed=seed)  # the run's default: J_max 5, role priority
    assert [adm.role[a.leaf - 1] for a in every] == ["main", "main", "compaction", "subagent"]
    # J_max below the number of leaves: the lowest class, the sub-agent's, is left out
    picked = admit(adm, config=dataclasses.replace(admission, j_max=3), seed=seed)
    assert [adm.role[a.leaf - 1] for a in picked] == ["main", "main", "compaction"]
