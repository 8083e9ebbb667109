"""Compaction and sub-agents: a branch and root attachments with the right parents and roles.

A main agent makes two tool turns; then, from the same history, it asks for a summary
(compaction, labelled by the x-gyre-role header) and also continues normally: the node
after turn 2 gets two children (a branch). After compaction the main agent restarts from
the summary (a root attachment); a sub-agent with its own fresh context is another root
attachment, and its second turn continues it. Role rules label calls without the header.
"""

from __future__ import annotations

from typing import Any

import openai
from conftest import MODEL, TOOLS, assert_paths_match_engine

from gyre.proxy.config import Config, RoleRule
from gyre.proxy.testing import running_proxy


def ask(
    client: openai.OpenAI,
    msgs: list[Any],
    *,
    role: str | None = None,
    tool: bool = False,
    max_tokens: int = 4,
) -> dict[str, Any]:
    headers = {"x-gyre-role": role} if role else {}
    r = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=TOOLS,
        tool_choice="required" if tool else "auto",
        max_tokens=120 if tool else max_tokens,
        extra_headers=headers,
    )
    return r.choices[0].message.model_dump(exclude_none=True)


def with_results(msgs: list[Any], message: dict[str, Any]) -> list[Any]:
    out = [*msgs, message]
    for call in message.get("tool_calls", []):
        out.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
    return out


def test_compaction_branch_and_subagent_roots(proxy: Any, engine_url: str) -> None:
    key = proxy.call(proxy.app.register_execution, "branchy", "main")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    main = [
        {"role": "system", "content": "Main agent."},
        {"role": "user", "content": "Fix the bug."},
    ]
    main = with_results(main, ask(client, main, tool=True))  # node 1
    main = with_results(main, ask(client, main, tool=True))  # node 2
    summary_req = [*main, {"role": "user", "content": "Summarize the conversation so far."}]
    summary = ask(client, summary_req, role="compaction", max_tokens=6)  # node 3: child of 2
    main_next = ask(client, main)  # node 4: child of 2
    restarted = [
        {"role": "system", "content": "Main agent."},
        {"role": "user", "content": "Summary: " + (summary.get("content") or "")},
    ]
    restarted = with_results(restarted, ask(client, restarted))  # node 5: root
    sub = [
        {"role": "system", "content": "You are a sub-agent."},
        {"role": "user", "content": "Find x."},
    ]
    sub = with_results(sub, ask(client, sub, role="subagent", tool=True))  # node 6: root
    ask(client, sub, role="subagent")  # node 7: child of 6
    assert main_next["role"] == "assistant"
    tree = proxy.call(proxy.app.tree, "branchy")
    got = [(n.node_id, n.parent_id, n.role) for n in tree.nodes]
    assert got == [
        (1, 0, "main"),
        (2, 1, "main"),
        (3, 2, "compaction"),
        (4, 2, "main"),
        (5, 0, "main"),
        (6, 0, "subagent"),
        (7, 6, "subagent"),
    ]
    assert tree.children(2) == [3, 4] and tree.children(0) == [1, 5, 6]
    assert sorted(tree.leaves()) == [3, 4, 5, 7]
    assert assert_paths_match_engine(proxy, "branchy", engine_url) == 7
    stats = tree.stats()
    assert stats.unique_tokens < stats.flat_tokens  # the shared prefix is stored once


def test_role_rules_label_calls_without_header(engine_url: str, tokenizer: Any) -> None:
    rules = [
        RoleRule(role="leak", pattern=r"(?i)bearer|authorization", source="headers"),
        RoleRule(role="compaction", pattern=r"(?i)summari[sz]e the conversation"),
        RoleRule(role="subagent", pattern=r"^You are a sub-agent", source="system"),
        RoleRule(role="helper", pattern=r"(?m)^x-agent-kind: helper$", source="headers"),
    ]
    config = Config(model_names=[MODEL], role_rules=rules, default_role="main")
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "ruled")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        ask(client, [{"role": "user", "content": "Please summarize the conversation."}])
        ask(
            client,
            [
                {"role": "system", "content": "You are a sub-agent."},
                {"role": "user", "content": "go"},
            ],
        )
        ask(client, [{"role": "user", "content": "hello"}])
        ask(client, [{"role": "user", "content": "hello"}], role="custom")
        helper = client.with_options(default_headers={"X-Agent-Kind": "helper"})
        ask(helper, [{"role": "user", "content": "help"}])
        roles = [n.role for n in p.call(p.app.tree, "ruled").nodes]
    # header rules see `name: value` lines, names lower-cased, never the credentials
    assert roles == ["compaction", "subagent", "main", "custom", "helper"]
