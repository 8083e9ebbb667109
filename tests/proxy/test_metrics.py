"""`/metrics` on a real proxy and engine: Prometheus text a Prometheus server can parse.

Calls through the official `openai` SDK (answered, refused, rerouted after an engine abort)
must show up as request / error counters, latency histograms, recorded calls, tokens and
reroutes that agree with the recorded tree; the route is admin-guarded like the others.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from conftest import MODEL, engine_requests
from prometheus_client.parser import text_string_to_metric_families

from gyre.proxy.config import Config
from gyre.proxy.errors import ApiError
from gyre.proxy.testing import RunningProxy, running_proxy

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(p: RunningProxy, token: str | None) -> tuple[int, str, Samples]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(p.url + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text, ctype = r.read().decode(), r.headers["content-type"]
    except urllib.error.HTTPError as e:
        return e.code, e.headers["content-type"], {}
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return 200, ctype, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def post(url: str, body: Any) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    urllib.request.urlopen(req, timeout=30).close()


def rerouted_call(p: RunningProxy, client: openai.OpenAI, engine_url: str) -> None:
    """One call whose first engine attempt is aborted (the engine paused, then the request
    aborted, as a cell switching to training does); the proxy retries it."""
    result: dict[str, Any] = {}

    def harness() -> None:
        result["r"] = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "and again"}], max_tokens=4
        )

    post(engine_url + "/pause_generation", {"mode": "retract"})
    try:
        thread = threading.Thread(target=harness)
        thread.start()
        deadline = time.monotonic() + 30
        while not (rids := [r for r in engine_requests(engine_url) if r.startswith("m1-2-")]):
            assert time.monotonic() < deadline, "the engine never received the call"
            time.sleep(0.02)
        post(engine_url + "/abort_request", {"rid": rids[0]})
    finally:
        post(engine_url + "/continue_generation", {})
    thread.join(60)
    assert "r" in result


@pytest.mark.slow
def test_metrics_count_calls_errors_tokens_and_reroutes(engine_url: str, tokenizer: Any) -> None:
    config = Config(model_names=[MODEL], reroute_wait_s=5.0)
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        assert scrape(p, None)[0] == 401 and scrape(p, "not-the-admin-token")[0] == 401
        key = p.call(p.app.register_execution, "m1", "main")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        rerouted_call(p, client, engine_url)
        bad_key = openai.OpenAI(base_url=p.url + "/v1", api_key="gyre-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad_key.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )

        status, ctype, m = scrape(p, p.admin_token)
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        tree = p.call(p.app.tree, "m1")
        chat = "OpenAIChatHandler"
        assert value(m, "gyre_proxy_requests_total", handler=chat, code="200") == 2
        assert value(m, "gyre_proxy_errors_total", handler=chat, code="401") == 1
        assert value(m, "gyre_proxy_errors_total", handler=chat, code="400") == 1
        assert value(m, "gyre_proxy_errors_total", handler=chat, code="404") == 1
        assert value(m, "gyre_proxy_errors_total", handler="MetricsHandler", code="401") == 2
        assert value(m, "gyre_proxy_request_seconds_count", handler=chat) == 5
        assert value(m, "gyre_proxy_request_seconds_bucket", handler=chat, le="+Inf") == 5
        assert total(m, "gyre_proxy_calls_total", role="main", engine="e0") == len(tree) == 2
        outputs = sum(len(n.output_ids) for n in tree.nodes)
        assert value(m, "gyre_proxy_tokens_total", kind="output") == outputs > 0
        inputs = sum(len(n.input_ids) for n in tree.nodes)
        assert value(m, "gyre_proxy_tokens_total", kind="input") == inputs
        contexts = sum(tree.path_length(n.parent_id) + len(n.input_ids) for n in tree.nodes)
        assert value(m, "gyre_proxy_context_tokens_sum") == contexts
        assert value(m, "gyre_proxy_reroutes_total") == tree.node(2).attempts - 1 == 1
        engine_s = sum(n.t_end - n.t_start for n in tree.nodes)
        assert value(m, "gyre_proxy_call_seconds_sum", engine="e0") == pytest.approx(engine_s)
        assert value(m, "gyre_proxy_executions", state="open") == 1
        assert value(m, "gyre_proxy_engines", state="live") == 1

        p.call(p.app.close_execution, "m1", "completed")
        _, _, again = scrape(p, p.admin_token)
        assert value(again, "gyre_proxy_executions", state="open") == 0
        assert value(again, "gyre_proxy_executions", state="closed") == 1
        assert total(again, "gyre_proxy_calls_total") == 2  # a second scrape counts nothing twice

        # an execution closed and dropped between scrapes (as a run's proxy node drops each
        # tree it has forwarded): its call is still counted, once, and it counts as closed
        key2 = p.call(p.app.register_execution, "m2", "main")
        other = openai.OpenAI(base_url=p.url + "/v1", api_key=key2, max_retries=0)
        other.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        with pytest.raises(ApiError, match="open: close it first"):
            p.call(p.app.forget_execution, "m2")
        p.call(p.app.close_execution, "m2", "completed")
        p.call(p.app.forget_execution, "m2")
        _, _, last = scrape(p, p.admin_token)
        assert total(last, "gyre_proxy_calls_total") == 3
        assert value(last, "gyre_proxy_executions", state="closed") == 2
        assert value(last, "gyre_proxy_executions", state="open") == 0
