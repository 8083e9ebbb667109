"""Rerouting: a call aborted by its engine (cell switching role) finishes at the new route.

Two real embedded engines A and B. Engine A is paused so the call sits there; the coordinator
(here: the test, through the admin routes) moves the execution to B and marks A draining,
then aborts the call on A. The harness sees one ordinary response; the tree holds one node
with attempts == 2, served by B, whose input equals what A had received.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from conftest import MODEL, assert_paths_match_engine, engine_requests

from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.rollout.testing import running_engine


def http(url: str, body: Any, *, token: str | None = None, method: str = "POST") -> Any:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method=method
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def engine_b() -> Iterator[str]:
    with running_engine("tiny") as url:
        yield url


def wait_for_rid(url: str, prefix: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rids = [r for r in engine_requests(url) if r.startswith(prefix)]
        if rids:
            return rids[0]
        time.sleep(0.02)
    raise AssertionError(f"engine never received {prefix}")


def test_abort_on_role_switch_is_retried_at_new_engine(
    engine_url: str, engine_b: str, tokenizer: Any
) -> None:
    config = Config(model_names=[MODEL], reroute_wait_s=10.0)
    with running_proxy({"A": engine_url, "B": engine_b}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "rr", "main")
        p.call(p.app.set_route, "rr", "A")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        result: dict[str, Any] = {}

        def harness() -> None:
            result["r"] = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "a long answer please"}],
                max_tokens=5,
            )

        http(engine_url + "/pause_generation", {"mode": "retract"})
        try:
            thread = threading.Thread(target=harness)
            thread.start()
            rid = wait_for_rid(engine_url, "rr-1-")
            http(p.url + "/admin/engines/A/drain", {"draining": True}, token=p.admin_token)
            http(p.url + "/admin/routes/rr", {"engine_id": "B"}, token=p.admin_token, method="PUT")
            http(engine_url + "/abort_request", {"rid": rid})
            thread.join(60)
        finally:
            http(engine_url + "/continue_generation", {})
        assert result["r"].choices[0].finish_reason in ("stop", "length")
        tree = p.call(p.app.tree, "rr")
        (node,) = tree.nodes
        assert (node.attempts, node.engine_id) == (2, "B")
        assert engine_requests(engine_url)[rid] == engine_requests(engine_b)[rid[:-2] + "-2"]
        assert assert_paths_match_engine(p, "rr", engine_b) == 1
        assert p.call(p.app.routes)["draining"] == ["A"]


def test_draining_engine_gets_no_new_calls(engine_url: str, engine_b: str, tokenizer: Any) -> None:
    with running_proxy(
        {"A": engine_url, "B": engine_b}, tokenizer=tokenizer, config=Config(model_names=[MODEL])
    ) as p:
        p.call(p.app.set_draining, "A")
        key = p.call(p.app.register_execution, "fresh")
        client = anthropic.Anthropic(base_url=p.url, api_key=key, max_retries=0)
        client.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
        assert p.call(p.app.tree, "fresh").node(1).engine_id == "B"


def test_no_engine_finishing_is_overloaded_not_a_hang(tokenizer: Any) -> None:
    config = Config(model_names=[MODEL], reroute_attempts=3, reroute_wait_s=0.1)
    with running_proxy({"dead": "http://127.0.0.1:9"}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "x")
        client = anthropic.Anthropic(base_url=p.url, api_key=key, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
        assert e.value.status_code == 529
        assert e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert len(p.call(p.app.tree, "x")) == 0


def test_engine_refusal_is_a_400_not_a_retry(engine_url: str, tokenizer: Any) -> None:
    """An input the engine rejects (longer than the model's context) is not retried."""
    config = Config(model_names=[MODEL], max_context_tokens=100_000, max_body_bytes=1 << 20)
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "huge")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                max_tokens=1,
                messages=[{"role": "user", "content": "lorem ipsum dolor " * 15000}],
            )
        assert "context" in str(e.value)
        assert len(p.call(p.app.tree, "huge")) == 0
