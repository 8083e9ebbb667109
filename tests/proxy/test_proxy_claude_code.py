"""Real Claude Code (the npm package) as a client of the proxy, when it is installed.

`tools/install_claude.sh` installs it into `<repo>/.tools` (or set GYRE_CLAUDE_BIN). Claude
Code streams `POST /v1/messages?beta=true` with its own system blocks, tools and
system-reminder messages; with a tiny output cap every reply ends by length and Claude Code
asks the model to resume, so one execution records a linear chain whose every path equals
what the engine received.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, assert_paths_match_engine

from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy

REPO = Path(__file__).resolve().parents[2]
CLAUDE = Path(os.environ.get("GYRE_CLAUDE_BIN", REPO / ".tools/node_modules/.bin/claude"))


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
