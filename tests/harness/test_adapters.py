"""Adapters are configuration: the built-in entries and their validation.

The shipped role rules are checked against short samples of each harness's requests
(paraphrased from what the proxy received from Claude Code 2.1.332 and Codex 0.171.0; the
real binaries are driven through the proxy in tests/proxy/test_proxy_claude_code.py and
test_proxy_codex.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import pytest

from gyre.errors import ConfigError
from gyre.harness import Adapter, builtin_adapters, get_adapter, load_adapters
from gyre.proxy.conversation import Conversation, Message
from gyre.proxy.service import header_lines, rule_role

CC_SYSTEM = "x-anthropic-billing-header: cc_version=2.1.332.0; cc_entrypoint=sdk-cli;\n\nYou..."
CC_SUB = CC_SYSTEM.replace("sdk-cli;", "sdk-cli; cc_is_subagent=true;")


@dataclass(frozen=True)
class Sample:
    """The texts of one harness request that role rules read; `role` None: main."""

    role: str | None
    last: str = "List the files."
    system: str = "You are a coding agent."
    first: str = "List the files."
    headers: str = "originator: cli"


SAMPLES: dict[str, list[Sample]] = {
    "claude_code": [
        Sample(None, system=CC_SYSTEM),
        Sample("subagent", system=CC_SUB, first="Count the files.", last="Count the files."),
        Sample("compaction", system=CC_SYSTEM, last="Text only, no tools. Write a detailed "
               "summary of the conversation so far: requests, files, errors, next steps."),
        Sample(None, system=CC_SYSTEM, first="This session continues an earlier one; its "
               "summary follows.", last="How many files?"),
    ],
    "codex": [
        Sample(None, headers="originator: codex_exec\nsession-id: 01a2"),
        Sample("subagent", last="Count the files here.", headers="originator: codex_exec\n"
               "x-openai-subagent: collab_spawn\nx-codex-parent-thread-id: 01a2"),
        Sample("compaction", last="This is a Context Checkpoint Compaction: write a handoff "
               "summary for the model that resumes."),
        Sample(None, last="Another model began this task; build on its summary below."),
    ],
    # mini-swe-agent has no sub-agents and never compacts: every call is the main agent's
    "mini_swe_agent": [Sample(None, last="Observation: 3 files")],
}  # fmt: skip


def test_builtin_adapters():
    adapters = builtin_adapters()
    assert {"reference", "claude_code", "claude_code_bare"} <= set(adapters)
    assert adapters["reference"].api == "openai" and adapters["reference"].applies_tool_latency
    cc = adapters["claude_code"]
    assert cc.api == "anthropic" and cc.command[:2] == ["claude", "-p"]
    assert cc.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and cc.env["IS_SANDBOX"] == "1"
    assert "--bare" in adapters["claude_code_bare"].command
    # Claude Code gets its sub-agent tool and a turn budget for long executions
    assert cc.params["tools"].split(",") == ["Bash", "Read", "Write", "Edit", "Agent"]
    assert cc.params["max_turns"] == "200"


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


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_shipped_role_rules_label_their_harness_calls(name: str) -> None:
    rules = get_adapter(name).role_rules
    for rule in rules:
        re.compile(rule.pattern)
    for sample in SAMPLES[name]:
        msgs = [Message("user", sample.first), Message("assistant", "ok")]
        conv = Conversation(sample.system, [], [*msgs, Message("user", sample.last)])
        assert rule_role(rules, conv, sample.headers) == sample.role, (name, sample)


def test_every_shipped_rule_compiles_and_only_the_tested_harnesses_have_rules() -> None:
    with_rules = {n for n, a in builtin_adapters().items() if a.role_rules}
    assert with_rules == {"claude_code", "claude_code_bare", "codex"}  # reference: x-gyre-role
    for adapter in builtin_adapters().values():
        for rule in adapter.role_rules:
            re.compile(rule.pattern)
    assert get_adapter("claude_code_bare").role_rules == get_adapter("claude_code").role_rules


def test_rule_headers_leave_out_credentials() -> None:
    got = header_lines([("Authorization", "Bearer k"), ("X-Api-Key", "k"), ("X-Gyre-Task", "x")])
    assert got == "x-gyre-task: x"


def test_bad_role_rules_name_the_adapter_and_what_is_allowed() -> None:
    def rules(*rule: dict[str, str]) -> None:
        load_adapters({"x": {"api": "openai", "command": ["x"], "role_rules": list(rule)}})

    with pytest.raises(ConfigError, match=r"adapters.x.role_rules\[0\].role: 'sub agent'; allowed"):
        rules({"role": "sub agent", "pattern": "a"})
    with pytest.raises(ConfigError, match=r"role_rules\[1\].source: 'body' is not allowed; choose "
                       r"one of 'system', 'first_user', 'last_user', 'headers'"):  # fmt: skip
        rules({"role": "a", "pattern": "a"}, {"role": "b", "pattern": "b", "source": "body"})
    with pytest.raises(ConfigError, match=r"role_rules\[0\].pattern: '\(' is not a valid regex"):
        rules({"role": "a", "pattern": "("})
    with pytest.raises(ConfigError, match=r"role_rules\[0\]: unknown key 'regex'; allowed keys"):
        rules({"role": "a", "regex": "a"})
