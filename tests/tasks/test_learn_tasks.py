"""The learnable suite's `sum` task scores each quarter of the skill it asks for, through its
own instantiated scoring command, run in a copy of the task's workspace as the evaluator runs it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gyre.tasks.suite import heldout_seed, named_suite


@pytest.mark.parametrize(
    ("files", "score"),
    [
        ({}, 0.0),  # nothing written
        ({"notes.txt": "19"}, 0.25),  # a new file, not the answer file
        ({"answer.txt": "the sum is {sum}"}, 0.5),  # the answer file, not digits only
        ({"answer.txt": "{wrong}\n"}, 0.75),  # digits, the wrong sum
        ({"answer.txt": " {sum}\n"}, 1.0),  # the sum (surrounding space is fine)
    ],
)
def test_sum_task_scores_each_quarter(tmp_path: Path, files: dict[str, str], score: float) -> None:
    task = named_suite("learn")["sum"].instantiate(heldout_seed(3))
    a, b = (int(x) for x in task.scoring.command[-2:])
    assert f"What is {a} plus {b}?" in task.instruction
    work = tmp_path / "ws"
    shutil.copytree(task.workspace, work)
    for name, text in files.items():
        (work / name).write_text(text.format(sum=a + b, wrong=a + b + 1))
    out = subprocess.run(task.scoring.command, cwd=work, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    assert float(out.stdout.strip().splitlines()[-1]) == score
