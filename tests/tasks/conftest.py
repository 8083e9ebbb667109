"""Fixtures for task-suite, scoring and evaluator tests (no engine, no proxy)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gyre.harness.events import Terminated
from gyre.tasks import TaskSuite, builtin_suite
from gyre.vocabulary import Outcome

SOLUTIONS = Path(__file__).parent / "solutions"


@pytest.fixture(scope="session")
def suite() -> TaskSuite:
    return builtin_suite()


@pytest.fixture(scope="session")
def solutions() -> Path:
    """Reference solutions: files overlaid on each built-in task's workspace."""
    return SOLUTIONS


@pytest.fixture
def make_terminated():
    """Factory of Terminated events (see `terminated`)."""
    return terminated


def terminated(
    workspace: Path | None,
    *,
    execution_id: str = "e0",
    budget_s: float = 30.0,
    assessable: bool = True,
    outcome: Outcome = Outcome.COMPLETED,
) -> Terminated:
    """A Terminated event as the runner would emit it for `workspace`."""
    now = time.time()
    return Terminated(
        execution_id=execution_id,
        outcome=outcome,
        reason="",
        returncode=0,
        t=now,
        t_launch=now - 1.0,
        deadline=now + budget_s,
        workspace=str(workspace) if workspace else None,
        stdout_path=None,
        stderr_path=None,
        assessable=assessable,
    )
