"""One execution's directory and environment.

Layout under the runner's workspace root, one directory per execution:

    <root>/<execution_id>/
        workspace/              fresh copy of the task's initial state; the harness's cwd
        workspace/.gyre_home/   HOME and TMPDIR of the harness (not part of the task state)
        instruction.md          the task instruction (read by adapters that take a file)
        feedback.jsonl          evaluator feedback for the harness ({"text": ...} per line)
        stdout.log stderr.log   the harness's output, kept with the execution
        snapshots/<state id>/   frozen states assessed by the evaluator

The harness gets only the environment it needs: PATH, HOME, TMPDIR, LANG, its API's base
URL and its own key, GYRE_EXECUTION_ID and the adapter's variables — never the runner's own
environment (other executions' keys, admin tokens). Sandboxed (`gyre.harness.sandbox`:
bubblewrap or Apptainer), the harness sees only an allow-list of the filesystem: the system,
its interpreter and program read-only, its own workspace writable, its instruction and
feedback files, a private /tmp and its own PID namespace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from gyre.errors import HarnessError
from gyre.harness.adapters import Adapter
from gyre.tasks.snapshot import HOME_DIRNAME, copy_workspace
from gyre.tasks.suite import Task

EXECUTION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin")


@dataclass(frozen=True, slots=True)
class ExecutionDir:
    """Paths of one prepared execution."""

    root: Path
    workspace: Path
    home: Path
    instruction_file: Path
    feedback_file: Path
    stdout: Path
    stderr: Path


def check_execution_id(execution_id: str) -> None:
    if not EXECUTION_ID.match(execution_id):
        raise HarnessError(
            f"execution id {execution_id!r} is not allowed; use 1-128 characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit"
        )


def prepare(root: Path, execution_id: str, task: Task) -> ExecutionDir:
    """Create the execution's directory with a fresh copy of the task's initial state."""
    check_execution_id(execution_id)
    d = root / execution_id
    if d.exists():
        raise HarnessError(
            f"execution directory {str(d)!r} already exists; execution ids must be unique"
        )
    if not task.workspace.is_dir():
        raise HarnessError(
            f"task {task.name!r}: initial state {str(task.workspace)!r} does not exist"
        )
    d.mkdir(parents=True)
    workspace = d / "workspace"
    try:
        copy_workspace(task.workspace, workspace)
    except (OSError, shutil.Error) as e:
        raise HarnessError(f"task {task.name!r}: cannot copy initial state: {e}") from None
    home = workspace / HOME_DIRNAME
    (home / "tmp").mkdir(parents=True)
    instruction = d / "instruction.md"
    instruction.write_text(task.instruction + "\n")
    (d / "feedback.jsonl").touch()
    return ExecutionDir(
        root=d,
        workspace=workspace,
        home=home,
        instruction_file=instruction,
        feedback_file=d / "feedback.jsonl",
        stdout=d / "stdout.log",
        stderr=d / "stderr.log",
    )


def harness_env(
    adapter: Adapter,
    adapter_env: dict[str, str],
    ex: ExecutionDir,
    *,
    execution_id: str,
    task: Task,
    proxy_url: str,
    api_key: str,
    keep: dict[str, str],
) -> dict[str, str]:
    """The complete environment of one harness process (nothing inherited implicitly)."""
    search = [str(Path(sys.executable).parent), *SYSTEM_PATH]
    env = {
        "PATH": os.pathsep.join(dict.fromkeys(search)),
        "HOME": str(ex.home),
        "TMPDIR": str(ex.home / "tmp"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "GYRE_EXECUTION_ID": execution_id,
        **keep,
    }
    base = proxy_url.rstrip("/")
    if adapter.api == "openai":
        env.update(OPENAI_BASE_URL=f"{base}/v1", OPENAI_API_KEY=api_key)
    else:
        env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY=api_key)
    if adapter.applies_tool_latency:
        query = f"{task.suite}/{task.name}/{task.instance}"  # a group's executions share it
        latency = task.tool_latency.for_execution(query, execution_id)
        env["GYRE_TOOL_LATENCY"] = json.dumps(latency.to_dict())
        env["GYRE_TOOL_SEED"] = str(zlib.crc32(f"{query}/{execution_id}".encode()))
    env.update(adapter_env)
    return env
