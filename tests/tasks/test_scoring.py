"""Scoring rules against real subprocesses: hidden tests with partial credit, commands."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import pytest

from gyre.tasks import EvaluatorError
from gyre.tasks.scoring import command, hidden_tests
from gyre.tasks.suite import ScoringConfig


def score(task, workspace: Path):
    return asyncio.run(hidden_tests(workspace, task))


def workspace_with(tmp_path: Path, name: str, source: str) -> Path:
    """A workspace holding one file, `name`, with `source`."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / name).write_text(source)
    return ws


@pytest.mark.slow
def test_every_builtin_task_is_solvable_and_starts_unsolved(suite, solutions, tmp_path):
    for task in suite:
        start = score(task, task.workspace)
        assert 0.0 <= start.value < 1.0, task.name
        solved = tmp_path / task.name
        shutil.copytree(task.workspace, solved)
        shutil.copytree(solutions / task.name, solved, dirs_exist_ok=True)
        result = score(task, solved)
        assert result.value == 1.0, (task.name, result.critique)
        assert result.detail["passed"] == result.detail["total"] >= 3


def test_partial_credit_is_the_fraction_passing(suite, tmp_path):
    task = suite["palindrome"]
    # case-insensitive but keeps punctuation: 5 of 6 hidden checks
    source = "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n"
    result = score(task, workspace_with(tmp_path, "palindrome.py", source))
    assert result.detail == {
        "passed": 5,
        "total": 6,
        "failed": ["test_palindrome::test_punctuation"],
    }
    assert result.value == pytest.approx(5 / 6)
    assert "5/6 hidden checks pass" in result.critique


def test_broken_code_is_a_valid_zero_not_an_evaluator_failure(suite, tmp_path):
    task = suite["add"]
    result = score(task, workspace_with(tmp_path, "calc.py", "def add(a, b) return a + b\n"))
    assert result.value == 0.0 and result.detail["total"] == 3


def test_hanging_code_fails_its_test_within_the_per_test_timeout(suite, tmp_path):
    task = dataclasses.replace(
        suite["add"], scoring=dataclasses.replace(suite["add"].scoring, per_test_timeout_s=0.3)
    )
    source = (
        "def add(a, b):\n    if a == 1:\n        while True:\n            pass\n    return a + b\n"
    )
    result = score(task, workspace_with(tmp_path, "calc.py", source))
    assert result.detail["passed"] == 2 and result.detail["failed"] == ["test_add::test_small"]


def test_code_under_test_cannot_fake_the_count(suite, tmp_path):
    task = suite["add"]
    source = (
        'import json, sys\nprint(\'{"total": 1, "passed": 1}\')\ndef add(a, b):\n    return 0\n'
    )
    result = score(task, workspace_with(tmp_path, "calc.py", source))
    assert result.detail["total"] == 3 and result.value == 0.0


def test_whole_run_timeout_is_an_evaluator_failure(suite, tmp_path):
    task = suite["add"]
    slow = dataclasses.replace(task, scoring=dataclasses.replace(task.scoring, timeout_s=0.5))
    ws = workspace_with(tmp_path, "calc.py", "import time\ntime.sleep(30)\n")  # hangs at import
    with pytest.raises(EvaluatorError, match="timed out"):  # before any per-test alarm
        score(slow, ws)


def command_task(suite, argv: list[str]):
    return dataclasses.replace(
        suite["add"], scoring=ScoringConfig(rule="command", command=argv, timeout_s=10)
    )


def test_command_rule(suite, tmp_path):
    (tmp_path / "out.txt").write_text("ok")
    good = command_task(suite, ["bash", "-c", "echo checking; test -f out.txt && echo 0.75"])
    assert asyncio.run(command(tmp_path, good)).value == 0.75
    for argv, match in [
        (["bash", "-c", "echo 0.5; exit 3"], "exited 3"),
        (["bash", "-c", "echo lots"], "no score"),
        (["bash", "-c", "echo 1.5"], r"must lie in \[0, 1\]"),
        (["/no/such/scorer"], "cannot start scorer"),
    ]:
        with pytest.raises(EvaluatorError, match=match):
            asyncio.run(command(tmp_path, command_task(suite, argv)))
