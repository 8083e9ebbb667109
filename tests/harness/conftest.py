"""Fixtures for harness tests: runners over temporary workspace roots, a shell adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gyre.harness import Adapter, ExecutionSpec, HarnessRunner
from gyre.tasks import TaskSuite, builtin_suite


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
