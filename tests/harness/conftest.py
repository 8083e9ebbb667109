"""Fixtures for harness tests: runners over temporary workspace roots, a shell adapter, and
one scripted run of a real harness CLI through a real proxy."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre.harness import Adapter, ExecutionSpec, HarnessRunner, Terminated
from gyre.models import tiny_tokenizer
from gyre.proxy.config import Config
from gyre.proxy.testing import ScriptedEngine, running_proxy
from gyre.tasks import Task, TaskSuite, builtin_suite
from gyre.trajectory import TrajectoryTree


@pytest.fixture(scope="session")
def suite() -> TaskSuite:
    return builtin_suite()


@pytest.fixture
def shell_adapter() -> Adapter:
    """A 'harness' that is a bash script (param `script`), speaking the OpenAI API."""
    return Adapter(
        name="sh", api="openai", command=["bash", "-c", "{script}"], params={"script": "true"}
    )


@pytest.fixture
def make_runner(tmp_path: Path):
    """Factory: a HarnessRunner over tmp_path/ws with short budgets, recording its events."""

    def make(**overrides):
        cfg = {
            "workspace_root": str(tmp_path / "ws"),
            "harness_timeout_s": 10.0,
            "overall_timeout_s": 30.0,
            "kill_grace_s": 0.5,
            **overrides,
        }
        events: list = []
        runner = HarnessRunner(HarnessRunner.Config(**cfg), on_event=events.append)
        runner.events = events  # type: ignore[attr-defined]
        return runner

    return make


@pytest.fixture
def spec_for(suite, shell_adapter):
    """Factory: an ExecutionSpec running `script` on a task (default: add)."""

    def make(script: str, *, execution_id: str = "e0", task: str = "add", **kw) -> ExecutionSpec:
        return ExecutionSpec(
            execution_id=execution_id,
            task=kw.pop("task_obj", None) or suite[task],
            adapter=kw.pop("adapter", shell_adapter),
            proxy_url="http://127.0.0.1:9",
            api_key=kw.pop("api_key", f"key-{execution_id}"),
            model="tiny",
            params={"script": script},
            **kw,
        )

    return make


def run(coro):
    return asyncio.run(coro)


@dataclass
class ProxiedRun:
    term: Terminated
    tree: TrajectoryTree  # the execution's recorded calls
    other: TrajectoryTree  # a second registered execution's: must stay empty


@pytest.fixture
def run_scripted_harness(tmp_path: Path):
    """Factory: run `adapter`'s real CLI on `task` against a proxy whose engine answers
    `replies`. A second execution is registered beside it, so a test can check that the
    harness's calls went to its own key's tree only."""
    return lambda *args: _run_scripted(tmp_path, *args)


def _run_scripted(
    tmp_path: Path, adapter: Adapter, task: Task, replies: list[str], config: Config
) -> ProxiedRun:
    tok = tiny_tokenizer()
    with running_proxy({"e0": ScriptedEngine(tok, replies)}, tokenizer=tok, config=config) as p:
        key = p.call(p.app.register_execution, "run-1", "main")
        p.call(p.app.register_execution, "run-other", "main")
        runner = HarnessRunner(
            HarnessRunner.Config(
                workspace_root=str(tmp_path / "ws"), harness_timeout_s=180, overall_timeout_s=240
            )
        )
        spec = ExecutionSpec(
            execution_id="run-1", task=task, adapter=adapter, proxy_url=p.url, api_key=key,
            model=config.model_names[0],
        )  # fmt: skip
        term = asyncio.run(runner.run(spec))
        return ProxiedRun(term, p.call(p.app.tree, "run-1"), p.call(p.app.tree, "run-other"))
