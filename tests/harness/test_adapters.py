"""Adapters are configuration: the built-in entries and their validation."""

from __future__ import annotations

import sys

import pytest

from gyre.errors import ConfigError
from gyre.harness import Adapter, builtin_adapters, get_adapter, load_adapters


def test_builtin_adapters():
    adapters = builtin_adapters()
    assert {"reference", "claude_code", "claude_code_bare"} <= set(adapters)
    assert adapters["reference"].api == "openai" and adapters["reference"].applies_tool_latency
    cc = adapters["claude_code"]
    assert cc.api == "anthropic" and cc.command[:2] == ["claude", "-p"]
    assert cc.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and cc.env["IS_SANDBOX"] == "1"
    assert "--bare" in adapters["claude_code_bare"].command


def test_render_fills_placeholders_and_overrides():
    ref = get_adapter("reference")
    values = {
        "python": sys.executable, "instruction": "do it", "instruction_file": "/x/instruction.md",
        "feedback_file": "/x/feedback.jsonl", "workspace": "/x/workspace", "model": "tiny",
        "execution_id": "e0",
    }  # fmt: skip
    argv, _env = ref.render(values, {"max_turns": "3", "delegate": "force"})
    assert argv[:3] == [sys.executable, "-m", "gyre.harness.reference_agent"]
    assert (
        argv[argv.index("--max-turns") + 1] == "3" and argv[argv.index("--delegate") + 1] == "force"
    )
    assert argv[argv.index("--max-tokens") + 1] == ref.params["max_tokens"]
    cc_argv, cc_env = get_adapter("claude_code").render(values, {"max_retries": "0"})
    assert cc_argv[2] == "do it" and cc_env["CLAUDE_CODE_MAX_RETRIES"] == "0"


def test_bad_adapters_are_clear_errors():
    with pytest.raises(ConfigError, match=r"unknown placeholder \{modle\}.*allowed: execution_id"):
        Adapter(api="openai", command=["x", "--model", "{modle}"])
    with pytest.raises(ConfigError, match="command: must name a program"):
        Adapter(api="openai", command=[])
    with pytest.raises(ConfigError, match=r"adapters.x.api: 'grpc' is not allowed"):
        load_adapters({"x": {"api": "grpc", "command": ["x"]}})
    with pytest.raises(ConfigError, match="adapter: 'codexx' is not known; allowed: claude_code"):
        get_adapter("codexx")
    with pytest.raises(ConfigError, match="unknown parameter 'turns' for adapter 'reference'"):
        get_adapter("reference").render({}, {"turns": "3"})


def test_program_resolution(tmp_path):
    tool = tmp_path / "bin" / "myharness"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    a = Adapter(api="openai", command=["myharness"], search_path=[str(tool.parent)])
    assert a.resolve_program("/usr/bin:/bin") == str(tool)
    assert Adapter(api="openai", command=["myharness"]).resolve_program("/usr/bin:/bin") is None
    assert Adapter(api="openai", command=["{python}"]).resolve_program("") == sys.executable
