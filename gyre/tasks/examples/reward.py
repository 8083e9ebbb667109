"""Reward of the example data suite `answers`: answer.txt compared with the row's answer.

Gyre's `python` scoring rule calls `score(workspace, data)` in a scratch copy of the
preserved workspace; `data` holds the row's fields that are not task keys (`answer`,
`topic`). Case, surrounding space and repeated spaces do not matter:

    1.0  answer.txt holds exactly the answer
    0.5  answer.txt holds the answer among other words
    0.1  answer.txt exists but does not hold the answer
    0.0  there is no answer.txt
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def score(workspace: Path, data: dict[str, Any]) -> dict[str, Any]:
    expected = normalize(str(data["answer"]))
    path = workspace / "answer.txt"
    if not path.is_file():
        return {"score": 0.0, "detail": {"match": "missing"}, "critique": "No answer.txt."}
    given = normalize(path.read_text(errors="replace"))
    if given == expected:
        return {"score": 1.0, "detail": {"match": "exact"}, "critique": "Correct."}
    if re.search(rf"(?<!\w){re.escape(expected)}(?!\w)", given):
        critique = "The answer is in answer.txt, but so is other text."
        return {"score": 0.5, "detail": {"match": "contains"}, "critique": critique}
    return {"score": 0.1, "detail": {"match": "wrong"}, "critique": "The answer is wrong."}
