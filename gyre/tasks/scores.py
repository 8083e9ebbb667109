"""What a scoring rule returns and raises: `Score`, `TestVerdict`, `EvaluatorError`.

Kept apart from the rules (`gyre.tasks.scoring`) so that a rule in its own module (the judge,
`gyre.tasks.judge`) and the rule table both import them without a cycle; `gyre.tasks.scoring`
re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from gyre.errors import GyreError
from gyre.tasks.suite import Task


class EvaluatorError(GyreError):
    """The evaluator could not produce a score for this state (the assessment is unresolved)."""


TestKind = Literal["fail_to_pass", "pass_to_pass"]
TestOutcome = Literal["passed", "failed", "error", "skipped", "not_reported"]
TEST_OUTCOMES: tuple[TestOutcome, ...] = ("passed", "failed", "error", "skipped", "not_reported")


@dataclass(frozen=True, slots=True)
class TestVerdict:
    """The outcome of one listed test of the `tests` rule (a repository task's scoring).

    Persisted as `to_dict()`: `{"test": node id, "kind": "fail_to_pass" | "pass_to_pass",
    "outcome": "passed" | "failed" | "error" | "skipped" | "not_reported"}` (`not_reported`:
    pytest did not report it, e.g. its file no longer imports).
    """

    __test__ = False  # not a test class, whatever pytest sees

    test: str  # pytest node id, as the task lists it
    kind: TestKind  # the task's list that names it
    outcome: TestOutcome

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    def to_dict(self) -> dict[str, str]:
        return {"test": self.test, "kind": self.kind, "outcome": self.outcome}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TestVerdict:
        """The verdict `to_dict()` wrote (a trace's meta, an export's JSON, eval.json)."""
        kind, outcome = d.get("kind"), d.get("outcome")
        if kind not in ("fail_to_pass", "pass_to_pass") or outcome not in TEST_OUTCOMES:
            raise ValueError(f"not a test verdict: {d!r}")
        return cls(test=str(d["test"]), kind=kind, outcome=outcome)


@dataclass(frozen=True, slots=True)
class Score:
    """A valid score of one state, with details and evaluator-authored feedback."""

    value: float
    detail: dict[str, Any] = field(default_factory=dict)
    critique: str = ""  # evaluator-authored text; EVALUATOR provenance if a policy call sees it
    tests: tuple[TestVerdict, ...] = ()  # rule `tests`: each listed test's outcome, as listed


Transcript = Mapping[str, Any]
"""An execution's transcript, JSON data (`gyre.trajectory.transcript.transcript`)."""


class ScoringRule(Protocol):
    async def __call__(
        self, state_dir: Path, task: Task, transcript: Transcript | None = None
    ) -> Score:
        """Score `state_dir`; `transcript`: the execution's, where the evaluator has it (a
        rule reads it only where the task asks, `scoring.transcript`)."""
