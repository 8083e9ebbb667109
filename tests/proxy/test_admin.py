"""Admin routes, keys, the HDF5 store, and the `gyre proxy` command as a user runs it."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from conftest import MODEL

from gyre.proxy.config import Config
from gyre.proxy.testing import running_proxy
from gyre.trajectory.store import TraceReader, TraceWriter, recover
from gyre.trajectory.tree import trees_equal


def admin(
    url: str, path: str, body: Any = None, *, token: str | None, method: str = "POST"
) -> tuple[int, Any]:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    data = None if body is None and method == "GET" else json.dumps(body or {}).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_admin_routes_keys_and_store(engine_url: str, tokenizer: Any, tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "trace.h5", run_meta={"test": True})
    config = Config(model_names=[MODEL])
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config, store=writer) as p:
        url, tok = p.url, p.admin_token
        assert admin(url, "/admin/executions", {"execution_id": "a"}, token=None)[0] == 401
        assert admin(url, "/admin/executions", {"execution_id": "a"}, token="wrong-token")[0] == 401
        status, body = admin(
            url, "/admin/executions", {"execution_id": "a", "role": "main"}, token=tok
        )
        assert status == 200 and body["key"].startswith("gyre-")
        assert admin(url, "/admin/executions", {"execution_id": "a"}, token=tok)[0] == 409
        assert admin(url, "/admin/executions", {"execution_id": 5}, token=tok)[0] == 400
        assert (
            admin(url, "/admin/routes/a", {"engine_id": "nope"}, token=tok, method="PUT")[0] == 404
        )
        assert (
            admin(url, "/admin/routes/zz", {"engine_id": "e0"}, token=tok, method="PUT")[0] == 404
        )
        assert admin(url, "/admin/routes/a", {"engine_id": "e0"}, token=tok, method="PUT")[0] == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key=body["key"], max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
            msgs += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "more"},
            ]
        status, summary = admin(url, "/admin/executions/a", token=tok, method="GET")
        assert (status, summary["nodes"], summary["closed"]) == (200, 2, False)
        status, summary = admin(url, "/admin/executions/a/close", {"status": "timeout"}, token=tok)
        assert (status, summary["status"], summary["nodes"]) == (200, "timeout", 2)
        assert admin(url, "/admin/executions/a/close", {}, token=tok)[0] == 409
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
        tree = p.call(p.app.tree, "a")
        # a caller that holds the tree elsewhere drops it; the id stays taken
        p.call(p.app.forget_execution, "a")
        status, body = admin(url, "/admin/executions/a", token=tok, method="GET")
        assert status == 404 and "no longer held" in body["error"]["message"], body
        assert admin(url, "/admin/executions", {"execution_id": "a"}, token=tok)[0] == 409
        p.call(p.app.close_store)
    with TraceReader(tmp_path / "trace.h5") as reader:
        assert trees_equal(reader.tree("a"), tree)
        (info,) = reader.executions()
        assert info.status == "timeout"


def read_url(proc: subprocess.Popen[bytes], timeout: float = 120) -> str:
    assert proc.stdout is not None
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline().decode()
            if "listening on " in line:
                return line.strip().rsplit(" ", 1)[-1]
        assert proc.poll() is None, "gyre proxy exited early"
    raise AssertionError("gyre proxy did not start")


def test_cli_serves_records_and_survives_a_kill(engine_url: str, tmp_path: Path) -> None:
    store, token_file = tmp_path / "t.h5", tmp_path / "admin.token"
    cmd = [
        sys.executable,
        "-m",
        "gyre.proxy.cli",
        "--engine",
        engine_url,
        "--port",
        "0",
        "--store",
        str(store),
        "--admin-token-file",
        str(token_file),
        "--model-name",
        MODEL,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        url = read_url(proc)
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode)[-3:] == "600"
        with urllib.request.urlopen(urllib.request.Request(url + "/", method="HEAD")) as r:
            assert r.status == 200
        keys = {
            e: admin(url, "/admin/executions", {"execution_id": e}, token=token)[1]["key"]
            for e in ("done", "open")
        }
        for e, key in keys.items():
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": e}]
            )
        assert admin(url, "/admin/executions/done/close", {}, token=token)[0] == 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if proc.stdout:
            proc.stdout.close()
    with TraceReader(store) as reader:
        assert reader.tree("done").node(1).role == "main"
    partial = recover(store)
    assert len(partial["open"]) == 1  # journaled before the crash
