"""Real Codex CLI (the npm package) as a client of the proxy's Responses API.

`tools/install_codex.sh` installs it into `<repo>/.tools` (or set GYRE_CODEX_BIN). Codex
streams `POST /v1/responses` with ~40 KB of developer instructions and its tools. With a
scripted policy it completes a task — one `exec_command` call that writes a file, then a
final answer — and its calls form one linear chain whose every path equals what the engine
received; against the real tiny engine (random text, cut by max tokens) Codex gets an
`incomplete` response, says so and exits 1, with its one call recorded. Driven to spawn a
sub-agent with a low auto-compaction limit, its calls are labelled main / compaction /
subagent by the codex adapter's shipped role rules, through the proxy as a run configures it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, assert_paths_match, assert_paths_match_engine, harness_run_config

from gyre.harness.codex import config_toml, find_codex
from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, ScriptedEngine, running_proxy
from gyre.runtime.proxy_node.node import proxy_config

CODEX = find_codex()
pytestmark = pytest.mark.skipif(
    CODEX is None, reason="Codex CLI not installed (tools/install_codex.sh)"
)
WRITE = (
    '<tool_call>\n{"name": "exec_command", "arguments": '
    '{"cmd": "echo gyre > done.txt && ls"}}\n</tool_call>'
)


def _codex(
    p: RunningProxy, key: str, root: Path, task: str, settings: str = ""
) -> subprocess.CompletedProcess[str]:
    """`codex exec` against the proxy; `settings`: top-level config.toml lines to add."""
    home, work = root / "home", root / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(settings + config_toml(MODEL, p.url + "/v1"))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "OPENAI_API_KEY": key}
    argv = [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access"]
    return subprocess.run(
        [*argv, task], cwd=work, env=env, capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_codex_completes_a_task_as_one_linear_exact_path(tokenizer: Any, tmp_path: Path) -> None:
    engine = ScriptedEngine(tokenizer, [WRITE, "I wrote done.txt."])
    config = Config(model_names=[MODEL], max_context_tokens=65536)
    with running_proxy({"e0": engine}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "codex-1", "main")
        run = _codex(p, key, tmp_path, "Write the word gyre into done.txt.")
        assert run.returncode == 0, run.stderr[-2000:]
        assert "I wrote done.txt." in run.stdout
        assert (tmp_path / "work" / "done.txt").read_text() == "gyre\n"
        tree = p.call(p.app.tree, "codex-1")
        assert [n.parent_id for n in tree.nodes] == [0, 1]
        assert tree.nodes[0].finish_reason == "tool_calls" and len(tree.nodes[0].input_ids) > 5000
        assert assert_paths_match(p, "codex-1", engine.requests) == 2
        assert b"done.txt" in tokenizer.decode(tree.nodes[1].input_ids).encode()  # tool output


def test_codex_against_the_real_engine_records_its_call(
    engine_url: str, tokenizer: Any, tmp_path: Path
) -> None:
    config = Config(model_names=[MODEL], max_context_tokens=65536, max_tokens_cap=8)
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "codex-2", "main")
        run = _codex(p, key, tmp_path, "List the files.")
        assert run.returncode == 1 and "Incomplete response" in run.stdout + run.stderr
        assert assert_paths_match_engine(p, "codex-2", engine_url) >= 1


def test_codex_subagent_and_compaction_are_labelled(tokenizer: Any, tmp_path: Path) -> None:
    run_cfg = harness_run_config("codex", 65536)
    spawn = (
        '<tool_call>\n{"name": "multi_agent_v1.spawn_agent", "arguments": '
        '{"message": "Count the files here."}}\n</tool_call>'
    )
    # later calls (the sub-agent's and the main agent's may interleave) all get "Done."
    engine = ScriptedEngine(tokenizer, [spawn])
    with running_proxy({"e0": engine}, tokenizer=tokenizer, config=proxy_config(run_cfg)) as p:
        key = p.call(p.app.register_execution, "codex-roles", "main")
        limit = "model_auto_compact_token_limit = 3000\n"  # below its first request: compacts
        run = _codex(p, key, tmp_path, "Count the files with a sub-agent.", limit)
        assert run.returncode == 0, run.stderr[-2000:]
        tree = p.call(p.app.tree, "codex-roles")
        assert assert_paths_match(p, "codex-roles", engine.requests) == len(tree)
    roles = [n.role for n in tree.nodes]
    assert roles[0] == "main" and {"compaction", "subagent"} <= set(roles), roles
