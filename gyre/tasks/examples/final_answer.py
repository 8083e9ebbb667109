"""Reward of the example data suite `math`: the last number of the execution's final answer.

Gyre's `python` scoring rule calls `score(workspace, data, transcript)` for a task whose
scoring says `transcript: true`; `transcript` is the execution's, read back from its
trajectory tree: `messages` (role, content) and `final_answer`, the policy's last
message. Only the final answer counts:

    1.0  its last number is the row's answer
    0.2  its last number is another number, but the answer appears earlier in the reply
    0.0  otherwise (no number, or a wrong one)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(workspace: Path, data: dict[str, Any], transcript: dict[str, Any]) -> dict[str, Any]:
    expected = float(data["answer"])
    numbers = [float(x) for x in NUMBER.findall(transcript["final_answer"].replace(",", ""))]
    if numbers and numbers[-1] == expected:
        return {"score": 1.0, "detail": {"match": "final"}, "critique": "Correct."}
    if expected in numbers:
        critique = "The answer is in the reply, but the reply ends with another number."
        return {"score": 0.2, "detail": {"match": "earlier"}, "critique": critique}
    given = "no number" if not numbers else f"{numbers[-1]:g}"
    return {"score": 0.0, "detail": {"match": "wrong"}, "critique": f"Wrong: {given}."}
