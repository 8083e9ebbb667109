"""The reference agent's tools, confined to its workspace: shell, read_file, write_file.

Paths are resolved (symlinks followed) and refused when they leave the workspace, so a
model cannot read or write outside it through the file tools, not even via a symlink it
created. The shell tool runs `bash -c` with cwd = workspace, a timeout (its process group
is killed), and a small environment (no keys, no proxy URL). A shell command can still
touch files outside the workspace: only the runner's bubblewrap sandbox (`sandbox: bwrap`)
makes the rest of the filesystem read-only and other workspaces invisible.

Every tool returns text for the model; bad arguments (missing, wrong type, nonsense from a
small model) become an error message, never an exception. An optional latency knob
(`ToolLatency`) sleeps before each result to give executions a realistic long tail.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.errors import HarnessError
from gyre.lifetime import die_with_parent
from gyre.tasks.latency import ToolLatency

MAX_OUTPUT_CHARS = 4000


class WorkspaceEscape(HarnessError):
    """A tool tried to touch a path outside its workspace."""


def _schema(
    name: str, description: str, props: dict[str, str], required: list[str]
) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                "required": required,
            },
        },
    }


TOOL_SCHEMAS = [
    _schema(
        "shell",
        "Run a bash command in the workspace; returns exit code and output.",
        {"command": "bash command line"},
        ["command"],
    ),
    _schema(
        "read_file",
        "Read a text file of the workspace.",
        {"path": "path relative to the workspace"},
        ["path"],
    ),
    _schema(
        "write_file",
        "Create or overwrite a text file of the workspace.",
        {"path": "path relative to the workspace", "content": "the complete new file content"},
        ["path", "content"],
    ),
]
DELEGATE_SCHEMA = _schema(
    "delegate",
    "Hand a self-contained sub-task to a sub-agent with a fresh context; returns its report.",
    {"task": "what the sub-agent should do and report"},
    ["task"],
)


class Workspace:
    """Tool implementations bound to one workspace directory."""

    def __init__(
        self,
        root: str | Path,
        *,
        shell_timeout_s: float = 30.0,
        latency: ToolLatency | None = None,
        seed: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.root = Path(root).resolve()
        self.shell_timeout_s = shell_timeout_s
        self.latency = latency or ToolLatency()
        self._rng = random.Random(seed)
        self._sleep = sleep
        self.tools: dict[str, Callable[[dict[str, Any]], str]] = {
            "shell": self.shell,
            "read_file": self.read_file,
            "write_file": self.write_file,
        }

    def resolve(self, path: object) -> Path:
        """The real path of `path` inside the workspace; WorkspaceEscape when outside."""
        if not isinstance(path, str) or not path.strip() or "\0" in path:
            raise WorkspaceEscape(f"path must be a non-empty string, got {path!r}")
        p = Path(path)
        full = (p if p.is_absolute() else self.root / p).resolve()
        if not full.is_relative_to(self.root):
            raise WorkspaceEscape(f"path {path!r} resolves to {str(full)!r}, outside the workspace")
        return full

    def call(self, name: str, arguments: object) -> str:
        """Run tool `name` with JSON-decoded `arguments`; always returns text."""
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        if not isinstance(arguments, dict):
            return f"error: arguments of {name} must be a JSON object, got {arguments!r:.200}"
        try:
            result = fn(arguments)
        except WorkspaceEscape as e:
            result = f"error: refused: {e}"
        except (OSError, UnicodeError, ValueError) as e:
            result = f"error: {type(e).__name__}: {e}"
        self.step_latency()
        return _clip(result)

    def step_latency(self) -> float:
        """Wait one sampled tool latency (the environment's time for one step); returns it."""
        delay = self.latency.sample(self._rng)
        if delay > 0:
            self._sleep(delay)
        return delay

    def read_file(self, args: dict[str, Any]) -> str:
        path = self.resolve(args.get("path"))
        if not path.is_file():
            return f"error: {args.get('path')!r} is not a file"
        return path.read_text(errors="replace")

    def write_file(self, args: dict[str, Any]) -> str:
        content = args.get("content")
        if not isinstance(content, str):
            return f"error: content must be a string, got {content!r:.100}"
        path = self.resolve(args.get("path"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path = self.resolve(str(path))  # parents may be symlinks created meanwhile
        path.write_text(content)
        return f"wrote {len(content)} characters to {path.relative_to(self.root)}"

    def shell(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            return f"error: command must be a non-empty string, got {command!r:.100}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", str(self.root)),
            "LANG": "C.UTF-8",
            "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        }
        proc = subprocess.Popen(  # the shell dies with the harness
            die_with_parent(["bash", "-c", command]), cwd=self.root, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=self.shell_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return f"error: command timed out after {self.shell_timeout_s:g}s\n{out.decode(errors='replace')}"
        return f"exit code {proc.returncode}\n{out.decode(errors='replace')}"


def _clip(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    half = MAX_OUTPUT_CHARS // 2
    return (
        f"{text[:half]}\n... [{len(text) - MAX_OUTPUT_CHARS} characters elided] ...\n{text[-half:]}"
    )
