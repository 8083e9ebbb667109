"""The words every floor of Gyre shares: outcomes, verdicts, roles, engine ids, role rules.

One definition of each, on the ground floor (standard library and `gyre.errors` only), so
the harness, the evaluator, the scheduler, the simulator, the proxy and the runtime speak
the same types instead of translating strings between them. Each value is the string Gyre
has always written into traces, journals and JSON files, so persisted data reads the same:

    Outcome.TIMED_OUT.value == "timed_out"        # how a harness ended
    CloseStatus.of(Outcome.FAILED).value          # how the trace closed it: "failed"
    VerdictStatus("excluded")                     # how its work was scored
    Role.TRAIN.value == "train"                   # what a cell does
    EngineId.parse("e3").index == 3; str(EngineId(3)) == "e3"
    RoleRule(role="subagent", source="system", pattern="cc_is_subagent=true")

A `RoleRule` is shared by the harness adapters (the rules shipped per harness) and the
proxy (which labels each model call with the first matching rule's role).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal

from gyre.errors import ConfigError

# the request header naming who wrote a call's new user messages, and its one allowed value:
# the proxy records the tokens of an evaluator-authored message with EVALUATOR provenance
PROVENANCE_HEADER, EVALUATOR_PROVENANCE = "x-gyre-provenance", "evaluator"
EVALUATOR_HEADERS = {PROVENANCE_HEADER: EVALUATOR_PROVENANCE}  # what a harness sends with them
ROLE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a call's role label; use fullmatch
RULE_SOURCES = ("system", "first_user", "last_user", "headers")


class Outcome(enum.Enum):
    """How an execution's harness ended; each termination counts once in f(t)."""

    COMPLETED = "completed"  # exited with status 0
    FAILED = "failed"  # non-zero exit, or could not be set up / started
    TIMED_OUT = "timed_out"  # exceeded its harness time budget; process group killed
    CANCELLED = "cancelled"  # cancelled by the coordinator; process group killed


class CloseStatus(enum.Enum):
    """How an execution was closed in the trace (its `status`): its harness's `Outcome`, or
    why it has none."""

    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    NOT_LAUNCHED = "not_launched"  # dispatched, never launched: the run or the job ended first
    UNRECOVERABLE = "unrecoverable"  # a dead job left it open before its first model call
    RECOVERED = "recovered"  # a dead job left it open; scored from its preserved workspace

    @classmethod
    def of(cls, outcome: Outcome) -> CloseStatus:
        """The close status of an execution whose harness ended with `outcome`."""
        return _CLOSED_AS[outcome]


_CLOSED_AS = {Outcome.COMPLETED: CloseStatus.COMPLETED, Outcome.FAILED: CloseStatus.FAILED,
              Outcome.TIMED_OUT: CloseStatus.TIMED_OUT,
              Outcome.CANCELLED: CloseStatus.CANCELLED}  # fmt: skip


class VerdictStatus(enum.Enum):
    """The designated assessment of an execution's preserved work (docs/evaluation.md)."""

    SCORED = "scored"  # a valid score (a valid zero included) is its reward
    EXCLUDED = "excluded"  # no valid score within the budget: no reward, never trained on
    PLACEHOLDER = "placeholder"  # no assessable work: the zero-reward failure placeholder


class Role(enum.Enum):
    """A cell's role; TO_* are the transitions between the two stable roles."""

    ROLLOUT = "rollout"
    TO_TRAIN = "to_train"
    TRAIN = "train"
    TO_ROLLOUT = "to_rollout"


@dataclass(frozen=True, slots=True, order=True)
class EngineId:
    """A rollout engine: cells' engines are 0..K-1, standalone ones K..K+S-1.

    Its string form ("e3") is how the proxy, its routes and the trace name the engine;
    `parse` is the one place that reads it back.
    """

    index: int

    def __str__(self) -> str:
        return f"e{self.index}"

    @classmethod
    def parse(cls, text: str) -> EngineId:
        """The engine named `text` ("e3"); ValueError for anything else."""
        digits = text[1:] if text.startswith("e") else ""
        if not digits.isdigit():
            raise ValueError(f"engine id {text!r}: expected 'e' and a number, e.g. 'e0'")
        return cls(int(digits))


@dataclass(kw_only=True, slots=True)
class RoleRule:
    """Label a model call `role` when the regex `pattern` is found in the chosen text."""

    role: str
    # role label given to matching calls ("compaction", "subagent", ...)
    pattern: str
    # Python regular expression, searched (not anchored)
    source: Literal["system", "first_user", "last_user", "headers"] = "last_user"
    # text searched: the system text, the first or last user message, or the request's
    # headers as `name: value` lines (names lower-case, credentials left out)

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not ROLE_RE.fullmatch(self.role):
            raise ConfigError(f"role: {self.role!r}; allowed: 1-64 chars of A-Z a-z 0-9 _ . -")
        if self.source not in RULE_SOURCES:
            raise ConfigError(f"source: {self.source!r}; allowed: {', '.join(RULE_SOURCES)}")
        try:
            re.compile(self.pattern)
        except (re.error, TypeError) as e:
            raise ConfigError(f"pattern: {self.pattern!r} is not a valid regex ({e})") from None
