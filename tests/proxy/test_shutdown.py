"""A call in flight when the proxy stops gets a retryable status the SDKs honour, never a 500.

The engine is `StubEngine` over HTTP holding every call, so the call is surely in flight
when the proxy stops. Stopping (`ProxyApp.stop`: what `running_proxy`'s exit, the run's
proxy node and `gyre proxy` on SIGTERM do) answers it at once: 503 in OpenAI's shape for
/v1/chat/completions and /v1/responses, Anthropic's 529 `overloaded_error` for
/v1/messages, each with `retry-after: 1` and `x-should-retry: true`; the proxy hangs up on
the engine (the call is cancelled there) and records no node. The official SDKs raise their
typed errors for it, and with retries on they do retry (the second attempt then finds no
server). After the stop nothing reaches the engine.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from conftest import MODEL
from test_admin import admin, read_url

from gyre.proxy.config import Config
from gyre.proxy.testing import StubEngine, running_proxy, running_stub_engine

MESSAGES = [{"role": "user", "content": "hello"}]
CONFIG = Config(model_names=[MODEL])


def call(api: str, url: str, key: str, *, stream: bool, retries: int = 0, hook: Any = None) -> Any:
    """One SDK call (streamed or not) through the proxy at `url` (`hook` sees each answer)."""
    http = httpx2.Client(event_hooks={"response": [hook]} if hook else None)
    messages: Any = MESSAGES
    if api == "anthropic":
        an = anthropic.Anthropic(base_url=url, api_key=key, max_retries=retries, http_client=http)
        return an.messages.create(model=MODEL, max_tokens=4, messages=messages, stream=stream)
    oa = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=retries, http_client=http)
    if api == "responses":
        return oa.responses.create(model=MODEL, input="hello", stream=stream)
    return oa.chat.completions.create(model=MODEL, messages=messages, stream=stream)


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def held(tokenizer: Any) -> Iterator[tuple[str, StubEngine]]:
    with running_stub_engine(tokenizer.eos_token_id, latency_s=None) as served:
        yield served


def check_overloaded(api: str, err: BaseException) -> None:
    """The SDK's typed error for the stop answer, with the retry headers."""
    if api == "anthropic":
        assert isinstance(err, anthropic.APIStatusError), repr(err)
        assert err.status_code == 529 and isinstance(err, anthropic.OverloadedError)
        assert err.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    else:
        assert isinstance(err, openai.InternalServerError), repr(err)
        assert err.status_code == 503
        assert err.body["code"] == "overloaded" and err.body["type"] == "server_error"  # type: ignore[index]
    assert err.response.headers["retry-after"] == "1"
    assert err.response.headers["x-should-retry"] == "true"
    assert "shutting down" in err.message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["openai", "responses", "anthropic"])
def test_call_in_flight_at_stop_gets_the_retryable_answer(
    held: tuple[str, StubEngine], tokenizer: Any, api: str, stream: bool
) -> None:
    url, stub = held
    with ThreadPoolExecutor(1) as pool:
        with running_proxy({"e0": url}, tokenizer=tokenizer, config=CONFIG) as p:
            key = p.call(p.app.register_execution, "x")
            pending: Future[Any] = pool.submit(call, api, p.url, key, stream=stream)
            wait_for(lambda: stub.in_flight == 1)
        # the proxy has stopped (ProxyApp.stop, then its loop ended)
        with pytest.raises(Exception) as caught:
            pending.result(timeout=30)
    check_overloaded(api, caught.value)
    assert len(p.app.tree("x")) == 0  # no node for the refused call
    wait_for(lambda: stub.dropped == 1)  # the proxy hung up on the engine: cancelled there


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_sdks_retry_the_stop_answer(held: tuple[str, StubEngine], tokenizer: Any, api: str) -> None:
    url, _stub = held
    statuses: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        with running_proxy({"e0": url}, tokenizer=tokenizer, config=CONFIG) as p:
            key = p.call(p.app.register_execution, "x")
            hook = lambda r: statuses.append(r.status_code)  # noqa: E731
            pending = pool.submit(call, api, p.url, key, stream=False, retries=1, hook=hook)
            wait_for(lambda: len(statuses) == 0 and _stub.in_flight == 1)
        with pytest.raises(Exception) as caught:
            pending.result(timeout=30)
    assert statuses == [529 if api == "anthropic" else 503]
    # it retried (after retry-after: 1 s) and found the proxy gone: a connection error
    assert isinstance(caught.value, (anthropic.APIConnectionError, openai.APIConnectionError))


def test_after_stop_nothing_reaches_the_engine(tokenizer: Any) -> None:
    config = Config(model_names=[MODEL])
    with (
        running_stub_engine(tokenizer.eos_token_id, latency_s=0.0) as (url, stub),
        running_proxy({"e0": url}, tokenizer=tokenizer, config=config) as p,
    ):
        key = p.call(p.app.register_execution, "x")
        parts = urllib.parse.urlsplit(p.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": MESSAGES})
        conn.request("POST", "/v1/messages", body, headers)
        assert conn.getresponse().read() and stub.calls == 1  # served; kept alive
        p.call(p.app.stop)
        try:  # the connection is closed by now, or the request still gets the answer
            conn.request("POST", "/v1/messages", body, headers)
            r = conn.getresponse()
            assert r.status == 529
            assert json.loads(r.read())["error"]["type"] == "overloaded_error"
        except (ConnectionError, http.client.HTTPException):
            pass
        conn.close()
        with pytest.raises(ConnectionError):  # nothing listens any more
            http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5).connect()
        assert stub.calls == 1 and len(p.call(p.app.tree, "x")) == 1


def test_gyre_proxy_sigterm_answers_the_call_in_flight(
    held: tuple[str, StubEngine], tmp_path: Path
) -> None:
    url, stub = held
    token_file = tmp_path / "admin.token"
    cmd = [sys.executable, "-m", "gyre.proxy.cli", "--engine", url, "--port", "0",
           "--model", "tiny", "--model-name", MODEL, "--admin-token-file", str(token_file),
           "--store", str(tmp_path / "t.h5")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        proxy_url = read_url(proc)
        token = token_file.read_text().strip()
        key = admin(proxy_url, "/admin/executions", {"execution_id": "x"}, token=token)[1]["key"]
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call, "anthropic", proxy_url, key, stream=True)
            wait_for(lambda: stub.in_flight == 1)
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(anthropic.OverloadedError) as caught:
                pending.result(timeout=30)
        check_overloaded("anthropic", caught.value)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc.stdout:
            proc.stdout.close()
