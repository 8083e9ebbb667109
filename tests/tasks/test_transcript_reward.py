"""Rewards from the transcript (issue 52, item 2): a python rule that asks for it
(`scoring.transcript: true`) gets the execution's messages and final answer, read back from
its trajectory tree, beside the workspace — as data, in the rule's own sandbox.

End to end through the runtime's `ExecutionHost` (what a run's proxy node and `gyre eval`
run): the reference agent, the real proxy recording the tree, the evaluator and the python
rule in its minimal environment; the policy is the proxy's `ScriptedEngine` (a random tiny
model never answers arithmetic), its replies tokenized with the real tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gyre.errors import ConfigError
from gyre.tasks import Evaluator, Validity, load_suite
from gyre.tasks.suite import ScoringConfig
from gyre.trajectory.transcript import transcript
from gyre.trajectory.tree import Provenance, TrajectoryTree
from gyre.vocabulary import VerdictStatus

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "gyre" / "tasks" / "examples"
P = Provenance

ECHO = '''\
import os

def echo(workspace, data, transcript):
    """Scores 1 and hands back what it was given, and what its sandbox looks like."""
    return {"score": 1.0, "detail": {"transcript": transcript, "files": sorted(os.listdir(
        workspace)), "env": sorted(os.environ)}}
'''


def _node(tree: TrajectoryTree, parent: int, inputs: list[tuple[int, list[int]]],
          output: list[int], role: str = "main") -> int:  # fmt: skip
    ids = [t for _, ts in inputs for t in ts]
    prov = [p for p, ts in inputs for _ in ts]
    node = tree.add_node(
        parent_id=parent, input_ids=np.array(ids), input_provenance=np.array(prov, np.uint8),
        output_ids=np.array(output), output_logprobs=np.full(len(output), -1.0, np.float32),
        role=role, policy_version=0, engine_id="e", t_start=1.0, t_end=2.0,
        finish_reason="stop", input_key=b"i%d" % len(tree), output_key=b"o%d" % len(tree),
    )  # fmt: skip
    return node.node_id


def test_the_transcript_is_the_final_main_calls_path_one_message_per_author_run() -> None:
    """Template tokens separate messages and are dropped; a run of one author within one
    call is one message; the final answer is the last main call's output, even where a
    sub-agent call came after it."""
    tree = TrajectoryTree("e0")
    t = 90  # a template token
    first = _node(tree, 0, [(P.TEMPLATE, [t]), (P.SYSTEM, [1, 2]), (P.TEMPLATE, [t, t]),
                            (P.USER, [3]), (P.TEMPLATE, [t]), (P.USER, [7]), (P.TEMPLATE, [t])],
                 [10, 11])  # fmt: skip
    main = _node(tree, first, [(P.TEMPLATE, [t]), (P.TOOL, [4]), (P.TEMPLATE, [t]),
                               (P.EVALUATOR, [5]), (P.TEMPLATE, [t])], [12])  # fmt: skip
    _node(tree, main, [(P.USER, [6])], [13, 14], role="subagent")

    def decode(ids: Any) -> str:
        return " ".join(f"w{i}" for i in ids if i != 14)  # 14: a special token, dropped

    got = transcript(tree, decode)
    assert got == {
        "messages": [
            {"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"},
            {"role": "user", "content": "w7"},
            {"role": "assistant", "content": "w10 w11"}, {"role": "tool", "content": "w4"},
            {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w12"},
        ],
        "final_answer": "w12", "calls": 3,
    }  # fmt: skip
    json.dumps(got)  # data: JSON all the way
    assert transcript(TrajectoryTree("e1"), decode) == {"messages": [], "final_answer": "",
                                                          "calls": 0}  # fmt: skip


def test_only_the_python_and_judge_rules_take_a_transcript() -> None:
    with pytest.raises(
        ConfigError, match="transcript: only for rules 'python' and 'judge', not 'command'"
    ):
        ScoringConfig(rule="command", command=["true"], transcript=True)


def _host(tmp_path: Path, suite: Path, task: str):
    """The runtime's execution host on `suite`, the reference agent answering in one turn."""
    from gyre.runtime.proxy_node.node import ExecutionHost
    from gyre.runtime.shared.config import load_run_config

    cfg = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    cfg["harness"].update({"suite": str(suite), "tasks": [task], "sandbox": "none",
                           "eval_attempts": 1})  # fmt: skip
    cfg["harness"]["params"].update({"tool_choice": "auto", "max_turns": "2"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ExecutionHost(load_run_config(path), tmp_path / "run")


def _execute(tmp_path: Path, suite: Path, task_name: str, replies: list[str]):
    """One execution of `task_name` whose policy says `replies`: (verdict record, assessments)."""
    from gyre.models import tiny_tokenizer
    from gyre.proxy.testing import ScriptedEngine

    host = _host(tmp_path, suite, task_name)
    task = host.suite[task_name].instantiate(0)

    async def run() -> Any:
        await host.start({"e0": ScriptedEngine(tiny_tokenizer(), replies)})
        try:
            return await host.execute(f"{task_name}-0", task, "e0")
        finally:
            host.stop()

    term, verdict = asyncio.run(run())
    assert term.outcome.value == "completed", term.reason
    return verdict, task


@pytest.mark.parametrize(
    ("reply", "reward", "match"),
    [
        ("12 * 12 = 144.", 1.0, "final"),
        ("Twelve twelves: 144. Hmm, no: 124", 0.2, "earlier"),
        ("I cannot tell.", 0.0, "wrong"),
    ],
)
def test_the_math_example_scores_the_final_answer_end_to_end(
    tmp_path: Path, reply: str, reward: float, match: str
) -> None:
    """docs/tasks.md "Rewards from the transcript": gyre/tasks/examples/math.jsonl."""
    verdict, _ = _execute(tmp_path, EXAMPLES / "math.jsonl", "square", [reply])
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == reward
    assert verdict.assessments[-1].detail == {"match": match}


def test_the_rule_gets_the_recorded_transcript_as_data_in_its_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the rule receives: the system prompt, the instruction and the policy's reply as
    the proxy recorded them, the reply as `final_answer`; nothing of it in the workspace, no
    key in its environment."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-do-not-leak")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "echo.py").write_text(ECHO)
    (tmp_path / "suite" / "workspace").mkdir()
    (tmp_path / "suite" / "workspace" / "README.md").write_text("Answer in your reply.\n")
    rows = [{"id": "q", "instruction": "What is 2 + 2? End with the number.", "answer": 4}]
    (tmp_path / "suite" / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "suite" / "q.suite.yaml").write_text(
        textwrap.dedent("""\
        defaults:
          scoring: {rule: python, function: "echo.py:echo", transcript: true}
    """)
    )
    verdict, task = _execute(tmp_path, tmp_path / "suite" / "q.jsonl", "q", ["2 + 2 = 4"])
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 1.0
    detail = verdict.assessments[-1].detail
    said = detail["transcript"]
    roles = [m["role"] for m in said["messages"]]
    assert roles == ["system", "user", "assistant"], said
    assert task.instruction in said["messages"][1]["content"]
    assert said["messages"][-1]["content"] == said["final_answer"] == "2 + 2 = 4"
    assert said["calls"] == 1
    assert detail["files"] == ["README.md"]  # the transcript is not put in the workspace
    assert "OPENAI_API_KEY" not in detail["env"]


def test_a_rule_asking_for_a_transcript_it_was_not_given_is_unresolved(
    tmp_path: Path, make_terminated
) -> None:
    """Never a zero: the evaluator without the transcript (`assess` without one) cannot
    score such a task; the attempt is unresolved, the execution excluded."""
    task = load_suite(EXAMPLES / "math.jsonl")["square"]
    ws = tmp_path / "ws"
    ws.mkdir()
    ev = Evaluator(Evaluator.Config(retry_backoff_s=0.0, max_attempts=1))
    verdict = asyncio.run(ev.assess(make_terminated(ws), task))
    assert verdict.status is VerdictStatus.EXCLUDED and verdict.reward is None
    (a,) = ev.log.for_execution("e0")
    assert a.validity is Validity.UNRESOLVED and "no transcript was passed" in a.error
    given = {"messages": [], "final_answer": "It is 144", "calls": 1}
    verdict = asyncio.run(Evaluator().assess(make_terminated(ws, execution_id="e1"), task, given))
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 1.0
