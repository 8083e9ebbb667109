"""Partial scoring of preserved work (paper §5.2): score, validity, assessed-state reference.

After an execution terminates — completed, failed, cancelled or timed out — the evaluator
freezes its workspace (content-addressed snapshot), then scores a scratch copy of that
snapshot under the task's rule. Outcomes:

* a score (also 0.0) → VALID assessment; the execution's reward is that score. Rewards are
  never derived from elapsed time, trajectory length or termination status.
* the rule fails (crash, timeout, unreadable output) → UNRESOLVED assessment; retried against
  the same frozen snapshot while the execution's overall budget lasts (pauses doubling from
  `retry_backoff_s` up to `max_backoff_s`; `max_attempts` caps the tries if set). Budget exhausted
  without a valid score → the execution is EXCLUDED (reward None), never given a zero.
* no assessable work (workspace setup failed, harness never started, workspace gone) →
  one PLACEHOLDER assessment with reward 0.0 (the paper's dummy failure trajectory).

Every assessment is appended to an `AssessmentLog` keyed by execution and state; later
assessments never overwrite earlier ones. `assess_intermediate` scores a live workspace
mid-execution (e.g. a critique fed back to the harness); such critique text, if a later
policy call sees it, is recorded with EVALUATOR provenance (see `feedback_text`).

    evaluator = Evaluator(Evaluator.Config(), log=AssessmentLog())
    verdict = await evaluator.assess(terminated, task)   # a harness `Terminated` event
    # a task whose python rule reads the transcript (`scoring.transcript`) also gets it:
    verdict = await evaluator.assess(terminated, task, transcript)  # gyre.trajectory.transcript
    verdict.status, verdict.reward      # SCORED 0.6 | EXCLUDED None | PLACEHOLDER 0.0
    verdict.tests                       # a repository task's per-test TestVerdicts; else ()

`assess` reads only the fields of `Ended` (which `gyre.harness.events.Terminated` has), so
the evaluator needs nothing from the harness package.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from gyre import fsafe
from gyre.errors import ConfigError
from gyre.tasks.scoring import RULES, EvaluatorError, Score, ScoringRule, TestVerdict, Transcript
from gyre.tasks.snapshot import copy_workspace, freeze
from gyre.tasks.suite import Task
from gyre.vocabulary import VerdictStatus


class Ended(Protocol):
    """A terminated execution, as far as scoring it goes (a harness `Terminated` event)."""

    @property
    def execution_id(self) -> str: ...

    @property
    def reason(self) -> str: ...  # why the harness did not complete ("" when it did)

    @property
    def deadline(self) -> float: ...  # end of the overall budget, unix seconds

    @property
    def workspace(self) -> str | None: ...  # the preserved workspace; None: setup failed

    @property
    def assessable(self) -> bool: ...  # False when there is no assessable work


class Validity(enum.Enum):
    VALID = "valid"  # a usable score (a valid zero included)
    UNRESOLVED = "unresolved"  # the evaluator failed; no score
    PLACEHOLDER = "placeholder"  # no assessable work: zero-reward failure placeholder


@dataclass(frozen=True, slots=True)
class Assessment:
    """One scoring attempt of one state of one execution."""

    execution_id: str
    seq: int  # 0, 1, ... within the execution, in recording order
    kind: Literal["final", "intermediate"]
    state_ref: str | None  # workspace snapshot id; None when there is no state
    validity: Validity
    score: float | None  # None unless VALID / PLACEHOLDER
    attempt: int  # 1-based attempt number against this state
    error: str  # evaluator failure or placeholder cause; "" when valid
    critique: str  # evaluator-authored feedback text
    detail: dict[str, Any]
    t_start: float
    t_end: float
    tests: tuple[TestVerdict, ...] = ()  # rule `tests`: each listed test's outcome (if VALID)

    def to_row(self) -> dict[str, Any]:
        """A flat row for the trace store's `assessments` table."""
        return {
            "execution_id": self.execution_id,
            "seq": self.seq,
            "kind": self.kind,
            "state_ref": self.state_ref or "",
            "validity": self.validity.value,
            "score": float("nan") if self.score is None else self.score,
            "attempt": self.attempt,
            "error": self.error,
            "critique": self.critique,
            "t_start": self.t_start,
            "t_end": self.t_end,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """The designated task assessment of an execution: its reward, or why there is none."""

    execution_id: str
    status: VerdictStatus
    reward: float | None  # None iff excluded
    assessment: Assessment  # the designating (or last) assessment
    attempts: int

    @property
    def usable(self) -> bool:
        """Whether the execution's reward may enter advantage estimation."""
        return self.status is not VerdictStatus.EXCLUDED

    @property
    def tests(self) -> tuple[TestVerdict, ...]:
        """Each listed test's outcome behind the reward (rule `tests`: a repository task's
        FAIL_TO_PASS, then PASS_TO_PASS tests); () for other rules and when not scored."""
        return self.assessment.tests if self.status is VerdictStatus.SCORED else ()


class RowSink(Protocol):
    def append(self, table: str, rows: list[dict[str, Any]]) -> None: ...


class AssessmentLog:
    """Append-only record of every assessment, by execution; optionally mirrored to a store."""

    def __init__(self, sink: RowSink | None = None) -> None:
        self._by_execution: dict[str, list[Assessment]] = {}
        self._sink = sink

    def next_seq(self, execution_id: str) -> int:
        return len(self._by_execution.get(execution_id, []))

    def record(self, a: Assessment) -> None:
        items = self._by_execution.setdefault(a.execution_id, [])
        if a.seq != len(items):
            raise ValueError(
                f"assessment seq {a.seq} for {a.execution_id!r}; expected {len(items)}"
            )
        items.append(a)
        if self._sink is not None:
            self._sink.append("assessments", [a.to_row()])

    def for_execution(self, execution_id: str) -> list[Assessment]:
        return list(self._by_execution.get(execution_id, []))

    def for_state(self, state_ref: str) -> list[Assessment]:
        return [
            a for items in self._by_execution.values() for a in items if a.state_ref == state_ref
        ]


def feedback_text(assessment: Assessment) -> str:
    """Evaluator-authored feedback on an intermediate assessment, for a harness to read.

    A harness that puts this text into a user message must send that request with
    `gyre.vocabulary.EVALUATOR_HEADERS`; the proxy then records those tokens with EVALUATOR
    provenance, so the critique stays in later calls' inputs but is never a training target.
    """
    if assessment.validity is Validity.VALID:
        return f"Evaluator feedback on state {assessment.state_ref}: {assessment.critique}"
    return f"Evaluator feedback on state {assessment.state_ref}: the evaluator could not score it."


class Evaluator:
    """Scores preserved workspaces with retries inside each execution's overall budget."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Evaluator settings."""

        # pause after the first failed attempt, seconds; it doubles after each further one
        retry_backoff_s: float = 0.2
        # the longest pause between attempts (a broken scorer is not run back to back)
        max_backoff_s: float = 5.0
        # at most this many attempts per state (0: as many as the budget allows)
        max_attempts: int = 0
        # where frozen snapshots go; "" puts them beside each workspace (<exec dir>/snapshots)
        snapshot_root: str = ""

        def __post_init__(self) -> None:
            if self.retry_backoff_s < 0:
                raise ConfigError(f"retry_backoff_s: {self.retry_backoff_s!r} must be >= 0")
            if self.max_backoff_s < self.retry_backoff_s:
                raise ConfigError(
                    f"max_backoff_s: {self.max_backoff_s!r} must be >= retry_backoff_s"
                )
            if self.max_attempts < 0:
                raise ConfigError(f"max_attempts: {self.max_attempts!r} must be >= 0")

    def __init__(
        self,
        config: Config | None = None,
        *,
        log: AssessmentLog | None = None,
        rules: dict[str, ScoringRule] | None = None,
    ) -> None:
        self.config = config or Evaluator.Config()
        self.log = log or AssessmentLog()
        self._rules = dict(RULES if rules is None else rules)

    async def assess(
        self, terminated: Ended, task: Task, transcript: Transcript | None = None
    ) -> Verdict:
        """The final assessment of a terminated execution (see the module docstring);
        `transcript`: the execution's, for a rule that reads it (`scoring.transcript`)."""
        eid = terminated.execution_id
        if not terminated.assessable or terminated.workspace is None:
            return self._placeholder(eid, terminated.reason or "no assessable work")
        try:
            state_ref, frozen = await asyncio.to_thread(
                freeze, terminated.workspace, self._snapshots_dir(terminated.workspace)
            )
        except Exception as e:  # workspace gone or unreadable: nothing left to assess
            return self._placeholder(eid, f"workspace could not be preserved: {e}")
        attempt = 0
        last: Assessment | None = None
        while time.time() < terminated.deadline and not self._attempts_exhausted(attempt):
            attempt += 1
            last = await self._attempt(
                eid, "final", state_ref, frozen, task, attempt, terminated.deadline, transcript
            )
            if last.validity is Validity.VALID:
                return Verdict(
                    execution_id=eid,
                    status=VerdictStatus.SCORED,
                    reward=last.score,
                    assessment=last,
                    attempts=attempt,
                )
            await asyncio.sleep(
                min(self.backoff(attempt), max(0.0, terminated.deadline - time.time()))
            )
        if last is None:  # the budget ran out before a single attempt
            last = self._record(
                eid,
                "final",
                state_ref,
                attempt,
                None,
                "overall budget exhausted before scoring",
                time.time(),
            )
        return Verdict(
            execution_id=eid,
            status=VerdictStatus.EXCLUDED,
            reward=None,
            assessment=last,
            attempts=attempt,
        )

    async def assess_intermediate(
        self, execution_id: str, workspace: str | Path, task: Task
    ) -> Assessment:
        """Score the workspace's current state once (mid-execution); recorded, never final."""
        state_ref, frozen = await asyncio.to_thread(
            freeze, workspace, self._snapshots_dir(workspace)
        )
        return await self._attempt(
            execution_id, "intermediate", state_ref, frozen, task, 1, float("inf")
        )

    async def _attempt(
        self, eid: str, kind: Literal["final", "intermediate"], state_ref: str, frozen: Path,
        task: Task, attempt: int, deadline: float, transcript: Transcript | None = None,
    ) -> Assessment:  # fmt: skip
        t0 = time.time()
        rule = self._rules.get(task.scoring.rule)
        try:
            if rule is None:
                raise EvaluatorError(f"scoring rule {task.scoring.rule!r} is not registered")
            score = await asyncio.wait_for(
                self._score_copy(rule, frozen, task, transcript), max(0.0, deadline - t0)
            )
        except TimeoutError:
            return self._record(
                eid, kind, state_ref, attempt, None, "overall budget ran out while scoring", t0
            )
        except Exception as e:  # any scorer failure leaves the assessment unresolved
            return self._record(eid, kind, state_ref, attempt, None, f"{type(e).__name__}: {e}", t0)
        return self._record(eid, kind, state_ref, attempt, score, "", t0)

    @staticmethod
    async def _score_copy(
        rule: ScoringRule, frozen: Path, task: Task, transcript: Transcript | None
    ) -> Score:
        with fsafe.temp_dir("gyre-eval-") as tmp:
            scratch = tmp / "workspace"
            await asyncio.to_thread(copy_workspace, frozen, scratch)
            try:
                score = await rule(scratch, task, transcript)
            finally:
                await asyncio.to_thread(fsafe.remove_tree, scratch, ignore_errors=True)
        if not 0.0 <= score.value <= 1.0:
            raise EvaluatorError(f"score {score.value!r} outside [0, 1]")
        return score

    def _record(
        self, eid: str, kind: Literal["final", "intermediate"], state_ref: str | None,
        attempt: int, score: Score | None, error: str, t0: float,
    ) -> Assessment:  # fmt: skip
        a = Assessment(
            execution_id=eid,
            seq=self.log.next_seq(eid),
            kind=kind,
            state_ref=state_ref,
            validity=Validity.VALID if score is not None else Validity.UNRESOLVED,
            score=score.value if score is not None else None,
            attempt=attempt,
            error=error,
            critique=score.critique if score is not None else "",
            detail=dict(score.detail) if score is not None else {},
            t_start=t0,
            t_end=time.time(),
            tests=score.tests if score is not None else (),
        )
        self.log.record(a)
        return a

    def _placeholder(self, eid: str, reason: str) -> Verdict:
        now = time.time()
        a = Assessment(
            execution_id=eid, seq=self.log.next_seq(eid), kind="final", state_ref=None,
            validity=Validity.PLACEHOLDER, score=0.0, attempt=0, error=reason, critique="",
            detail={}, t_start=now, t_end=now,
        )  # fmt: skip
        self.log.record(a)
        return Verdict(execution_id=eid, status=VerdictStatus.PLACEHOLDER, reward=0.0, assessment=a,
                       attempts=0)  # fmt: skip

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (1, 2, ...): exponential, capped."""
        c = self.config
        return min(c.max_backoff_s, c.retry_backoff_s * 2.0 ** (attempt - 1))

    def _attempts_exhausted(self, attempt: int) -> bool:
        return self.config.max_attempts > 0 and attempt >= self.config.max_attempts

    def _snapshots_dir(self, workspace: str | Path) -> Path:
        if self.config.snapshot_root:
            return Path(self.config.snapshot_root)
        return Path(workspace).resolve().parent / "snapshots"
