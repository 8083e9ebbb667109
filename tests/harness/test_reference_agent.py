"""The reference agent as a black-box harness against the real proxy and embedded engine.

Engine: `gyre engine --model tiny` in a subprocess; proxy: a Tornado server on its own
thread; the agent: `python -m gyre.harness.reference_agent` started by the HarnessRunner
with a key from the proxy's admin route. The tiny model is random, so action turns use
`tool_choice=required` (constrained decoding) and a test configuration that forces one
delegation and compaction on every turn.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from gyre.harness import ExecutionSpec, HarnessRunner, Launched, get_adapter
from gyre.models import tiny_tokenizer
from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.rollout.testing import running_engine
from gyre.tasks import Evaluator, Validity, snapshot_id
from gyre.trajectory.tree import Provenance
from gyre.vocabulary import Outcome, VerdictStatus

MODEL = "gyre-tiny"
FORCE_BRANCHES = {
    "max_turns": "3",
    "max_tokens": "160",
    "compact_at": "1",  # compact before every turn after the first
    "summary_tokens": "48",
    "delegate": "force",  # the first main turn must delegate
    "subagent_turns": "2",
    "tool_choice": "required",
}


@pytest.fixture(scope="module")
def proxy():
    config = Config(model_names=[MODEL])
    with (
        running_engine("tiny") as url,
        running_proxy({"e0": url}, tokenizer=tiny_tokenizer(), config=config) as p,
    ):
        yield p


def run_agent(p, tmp_path, execution_id, params, *, task, feedback=None, sandbox="none"):
    key = p.admin("/admin/executions", {"execution_id": execution_id, "role": "main"})["key"]
    events: list = []
    runner: HarnessRunner

    def on_event(e):
        events.append(e)
        if feedback and isinstance(e, Launched):
            runner.send_feedback(e.execution_id, feedback)

    cfg = HarnessRunner.Config(
        workspace_root=str(tmp_path / "ws"),
        harness_timeout_s=240,
        overall_timeout_s=300,
        sandbox=sandbox,
    )
    runner = HarnessRunner(cfg, on_event=on_event)
    spec = ExecutionSpec(
        execution_id=execution_id, task=task, adapter=get_adapter("reference"),
        proxy_url=p.url, api_key=key, model=MODEL, params=params,
    )  # fmt: skip
    term = asyncio.run(runner.run(spec))
    report = json.loads(Path(term.stdout_path).read_text().strip().splitlines()[-1])["report"]
    return term, report


def test_reference_agent_builds_a_multi_branch_tree_and_is_scored(proxy, tmp_path, suite):
    task = suite["fizzbuzz"]
    term, report = run_agent(proxy, tmp_path, "ref-branches", FORCE_BRANCHES, task=task)
    assert term.outcome is Outcome.COMPLETED, Path(term.stderr_path).read_text()[-2000:]
    assert report["turns"] == 3 and report["compactions"] >= 1 and report["delegations"] >= 1

    tree = proxy.call(proxy.app.tree, "ref-branches")
    roles = [n.role for n in tree.nodes]
    assert {"main", "subagent", "compaction"} <= set(roles)
    assert roles.count("main") == 3 and roles.count("compaction") == report["calls"]["compaction"]
    assert len(tree) == sum(report["calls"].values())  # every call recorded, nothing else
    assert len(tree.leaves()) >= 3  # compaction and the sub-agent branch off the main path
    for n in tree.nodes:
        if n.role == "compaction":  # a compaction shares the main context it summarizes
            assert tree.node(n.parent_id).role == "main"
        if n.role == "main" and n.node_id != tree.nodes[0].node_id:
            assert n.parent_id == 0  # after compaction: a fresh history, a new trajectory
    sub_roots = [n for n in tree.nodes if n.role == "subagent" and n.parent_id == 0]
    assert sub_roots  # the sub-agent's fresh context starts its own branch
    proxy.admin("/admin/executions/ref-branches/close", {"status": "completed"})

    verdict = asyncio.run(Evaluator().assess(term, task))
    assert verdict.status is VerdictStatus.SCORED and verdict.assessment.validity is Validity.VALID
    assert verdict.assessment.state_ref == snapshot_id(term.workspace)
    assert 0.0 <= verdict.reward <= 1.0


def test_evaluator_feedback_is_recorded_with_evaluator_provenance(proxy, tmp_path, suite):
    params = {**FORCE_BRANCHES, "max_turns": "2", "compact_at": "100000", "delegate": "off"}
    text = "Evaluator feedback check: 1/5 hidden checks pass."
    term, report = run_agent(
        proxy, tmp_path, "ref-feedback", params, task=suite["fizzbuzz"], feedback=text
    )
    assert term.outcome is Outcome.COMPLETED and report["turns"] == 2
    tree = proxy.call(proxy.app.tree, "ref-feedback")
    first, second = tree.nodes
    assert second.parent_id == first.node_id
    evaluator = second.input_provenance == Provenance.EVALUATOR
    assert evaluator.any() and not (first.input_provenance == Provenance.EVALUATOR).any()
    assert text in tiny_tokenizer().decode(second.input_ids[evaluator].tolist())
    path = tree.materialize(second.node_id)
    assert not path.trainable[path.provenance == Provenance.EVALUATOR].any()
    assert np.array_equal(path.trainable, path.provenance == Provenance.POLICY)


def test_calls_land_in_the_callers_execution_only(proxy, tmp_path, suite):
    proxy.admin("/admin/executions", {"execution_id": "bystander"})
    params = {**FORCE_BRANCHES, "max_turns": "1", "delegate": "off"}
    # inside bubblewrap where installed: the sandbox still reaches the proxy on 127.0.0.1
    term, _ = run_agent(proxy, tmp_path, "ref-own", params, task=suite["add"], sandbox="auto")
    assert term.outcome is Outcome.COMPLETED, Path(term.stderr_path).read_text()[-2000:]
    assert len(proxy.call(proxy.app.tree, "ref-own")) == 1
    assert len(proxy.call(proxy.app.tree, "bystander")) == 0


def test_a_rejected_key_fails_the_execution_with_the_reason(proxy, tmp_path, suite):
    runner = HarnessRunner(
        HarnessRunner.Config(
            workspace_root=str(tmp_path / "ws"), harness_timeout_s=60, overall_timeout_s=90
        )
    )
    spec = ExecutionSpec(
        execution_id="ref-badkey", task=suite["add"], adapter=get_adapter("reference"),
        proxy_url=proxy.url, api_key="gyre-not-a-key", model=MODEL, params={"max_turns": "1"},
    )  # fmt: skip
    term = asyncio.run(runner.run(spec))
    assert term.outcome is Outcome.FAILED and term.returncode == 1
    assert "HTTP 401" in term.reason, term.reason


def test_turns_cut_off_by_max_tokens_still_wait_the_tool_latency(proxy, tmp_path):
    """A model that never finishes a call within max_tokens keeps the latency knob's tail."""
    from gyre.harness.reference_agent import AgentConfig, ChatClient, ReferenceAgent
    from gyre.harness.tools import Workspace
    from gyre.tasks.suite import ToolLatency

    key = proxy.admin("/admin/executions", {"execution_id": "cutoff", "role": "main"})["key"]
    slept: list[float] = []
    ws = Workspace(tmp_path, latency=ToolLatency(dist="fixed", seconds=0.5), sleep=slept.append)
    cfg = AgentConfig(model=MODEL, instruction="Implement add(a, b) in calc.py.", max_turns=3,
                      max_tokens=3, tool_choice="required", delegate="off")  # fmt: skip
    client = ChatClient(proxy.url + "/v1", key, max_retries=0)
    report = ReferenceAgent(cfg, client, ws).run()
    assert report.turns == 3 and report.stop == "turn limit"
    assert slept == [0.5, 0.5, 0.5]  # three cut-off turns, one environment step each
    proxy.admin("/admin/executions/cutoff/close", {"status": "completed"})


def test_a_forced_delegation_cut_off_by_max_tokens_still_delegates(proxy, tmp_path):
    """`--delegate force` promises a sub-agent branch even when the forced call does not fit
    in max_tokens (SmolLM2 wrote a long task and was cut: a tree without a sub-agent)."""
    from gyre.harness.reference_agent import AgentConfig, ChatClient, ReferenceAgent
    from gyre.harness.tools import Workspace

    key = proxy.admin("/admin/executions", {"execution_id": "cut-force", "role": "main"})["key"]
    cfg = AgentConfig(model=MODEL, instruction="Implement add(a, b) in calc.py.", max_turns=1,
                      max_tokens=3, tool_choice="required", delegate="force",
                      subagent_turns=1)  # fmt: skip
    report = ReferenceAgent(cfg, ChatClient(proxy.url + "/v1", key, max_retries=0),
                            Workspace(tmp_path)).run()  # fmt: skip
    assert report.delegations == 1
    roles = [n.role for n in proxy.call(proxy.app.tree, "cut-force").nodes]
    assert roles == ["main", "subagent"]
    proxy.admin("/admin/executions/cut-force/close", {"status": "completed"})


def test_chat_client_retries_what_the_sdk_retries_and_names_what_it_refuses():
    """503 and 429 are retried (honouring retry-after); a 400 is not and its message is kept."""
    import http.server
    import threading

    from gyre.harness.reference_agent import ChatClient, ProxyError

    replies = [(503, {}), (429, {"retry-after": "0"}), (200, {}), (400, {})]
    seen: list[dict[str, object]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # the stdlib handler method name
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append({"path": self.path, "auth": self.headers["authorization"],
                         "role": self.headers["x-gyre-role"], "model": body["model"]})  # fmt: skip
            status, headers = replies.pop(0)
            reply = {"choices": [{"message": {"role": "assistant", "content": "hi"},
                                  "finish_reason": "stop"}]} if status == 200 else \
                {"error": {"message": f"status {status} here", "type": "x"}}  # fmt: skip
            data = json.dumps(reply).encode()
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ChatClient(f"http://127.0.0.1:{server.server_port}/v1", "k", max_retries=2)
        out = client.create({"model": "m", "messages": []}, {"x-gyre-role": "main"})
        assert out["choices"][0]["message"]["content"] == "hi"
        assert [s["path"] for s in seen] == ["/v1/chat/completions"] * 3
        assert {s["auth"] for s in seen} == {"Bearer k"} and {s["role"] for s in seen} == {"main"}
        with pytest.raises(ProxyError, match="HTTP 400: status 400 here"):
            client.create({"model": "m", "messages": []}, {"x-gyre-role": "main"})
        assert len(seen) == 4 and not replies  # the 400 was not retried
        replies[:] = [(503, {"retry-after": "0"})] * 3
        with pytest.raises(ProxyError, match="HTTP 503"):  # retries exhausted
            client.create({"model": "m", "messages": []}, {"x-gyre-role": "main"})
        assert len(seen) == 7
    finally:
        server.shutdown()
        server.server_close()
