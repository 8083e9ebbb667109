"""The reference agent's tools: confinement to the workspace, graceful bad arguments."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import all_gone, pids_with

from gyre.harness.tools import MAX_OUTPUT_CHARS, Workspace, WorkspaceEscape
from gyre.tasks import ToolLatency


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    root = tmp_path / "workspace"
    root.mkdir()
    (root / "a.txt").write_text("hello\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    return Workspace(root, shell_timeout_s=2.0)


def test_read_write_inside(ws):
    assert ws.call("read_file", {"path": "a.txt"}) == "hello\n"
    assert ws.call("write_file", {"path": "pkg/new.py", "content": "X = 1\n"}).startswith(
        "wrote 6 characters"
    )
    assert (ws.root / "pkg" / "new.py").read_text() == "X = 1\n"
    assert (
        ws.call("read_file", {"path": str(ws.root / "a.txt")}) == "hello\n"
    )  # absolute inside: fine


@pytest.mark.parametrize("path", ["../secret.txt", "/etc/passwd", "pkg/../../secret.txt", "/"])
def test_paths_outside_are_refused(ws, path):
    assert ws.call("read_file", {"path": path}).startswith("error: refused: path")
    assert ws.call("write_file", {"path": path, "content": "x"}).startswith("error: refused")
    assert (ws.root.parent / "secret.txt").read_text() == "outside\n"


def test_symlink_escapes_are_refused(ws):
    os.symlink(ws.root.parent, ws.root / "up")
    os.symlink(ws.root.parent / "secret.txt", ws.root / "s.txt")
    os.symlink(ws.root.parent / "new-file", ws.root / "dangling")
    assert ws.call("read_file", {"path": "up/secret.txt"}).startswith("error: refused")
    assert ws.call("read_file", {"path": "s.txt"}).startswith("error: refused")
    assert ws.call("write_file", {"path": "s.txt", "content": "pwned"}).startswith("error: refused")
    assert ws.call("write_file", {"path": "dangling", "content": "pwned"}).startswith(
        "error: refused"
    )
    assert ws.call("write_file", {"path": "up/x/y.txt", "content": "pwned"}).startswith(
        "error: refused"
    )
    assert (ws.root.parent / "secret.txt").read_text() == "outside\n"
    assert not (ws.root.parent / "new-file").exists() and not (ws.root.parent / "x").exists()


@settings(max_examples=200, deadline=None)
@given(path=st.text(alphabet="./ab\\~$*\0", max_size=12))
def test_resolve_never_leaves_the_workspace(tmp_path_factory, path):
    root = tmp_path_factory.mktemp("w")
    ws = Workspace(root)
    try:
        resolved = ws.resolve(path)
    except WorkspaceEscape:
        return
    assert resolved == ws.root or ws.root in resolved.parents


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("read_file", {}, "error: refused: path must be a non-empty string"),
        ("read_file", {"path": 3}, "error: refused: path must be a non-empty string"),
        ("read_file", {"path": "nope.txt"}, "error: 'nope.txt' is not a file"),
        ("write_file", {"path": "x"}, "error: content must be a string"),
        ("write_file", {"path": "a.txt/inner", "content": "x"}, "error: "),
        ("shell", {"command": ""}, "error: command must be a non-empty string"),
        ("shell", {"cmd": "ls"}, "error: command must be a non-empty string"),
        ("teleport", {}, "error: unknown tool 'teleport'; available: read_file, shell, write_file"),
        ("shell", ["ls"], "error: arguments of shell must be a JSON object"),
        ("read_file", {"path": "."}, "error: '.' is not a file"),
    ],
)
def test_nonsense_arguments_become_tool_errors(ws, name, args, expected):
    assert ws.call(name, args).startswith(expected)


def test_shell_runs_in_the_workspace_with_a_small_env(ws, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "do-not-leak")
    out = ws.call("shell", {"command": "pwd; cat a.txt; env; exit 3"})
    assert out.startswith("exit code 3\n") and str(ws.root) in out and "hello" in out
    assert "do-not-leak" not in out


def test_shell_timeout_kills_the_command_group(ws):
    marker = f"{100 + random.random():.6f}"  # a sleep duration no other process carries
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(pids_with(marker))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.time()
    try:
        out = ws.call("shell", {"command": f"sleep {marker} & echo started; wait"})
    finally:
        done.set()
        watcher.join()
    assert out.startswith("error: command timed out after 2s") and "started" in out
    assert time.time() - t0 < 5
    assert seen, "the command's background sleep ran"
    assert all_gone(seen), f"still alive after the timeout: {sorted(seen)}"


def test_long_output_is_clipped(ws):
    out = ws.call("shell", {"command": "yes | head -c 20000"})
    assert len(out) < MAX_OUTPUT_CHARS + 100 and "characters elided" in out


def test_latency_knob_sleeps_before_each_result(tmp_path):
    slept: list[float] = []
    ws = Workspace(tmp_path, latency=ToolLatency(dist="fixed", seconds=0.25), sleep=slept.append)
    ws.call("shell", {"command": "true"})
    ws.call("read_file", {"path": "../x"})  # refused calls take time too
    assert slept == [0.25, 0.25]
