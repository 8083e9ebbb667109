"""Execution rewards, group readiness and group-relative advantages.

Each execution of a rollout group ends with one designated outcome (§5.2):

* ``VALID``       — the evaluator returned a score (a valid zero is a real reward);
* ``PLACEHOLDER`` — a complete infrastructure failure with nothing to assess: reward 0,
  no trainable targets (it still counts in the group's reward statistics);
* ``EXCLUDED``    — the execution's overall budget expired without a valid score: its
  trajectories are dropped and it takes no part in the group statistics;
* ``PENDING``     — not closed yet, or scored but the assessment is still unresolved.

A group is *ready* when it has all N executions and none is PENDING. Advantages are computed
from the original execution rewards of the non-excluded executions:

    A_i = (r_i - mean(r)) / (std(r) + eps)        (scale_by_std=True, population std)
    A_i =  r_i - mean(r)                          (scale_by_std=False)

    outcomes = [ExecutionOutcome(execution_id="e0", status=Status.VALID, reward=1.0), ...]
    adv = group_advantages(outcomes, group_size=16, config=AdvantageConfig())
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gyre.errors import ConfigError, TrainingError
from gyre.vocabulary import VerdictStatus


class Status(enum.Enum):
    """The designated outcome of one execution."""

    PENDING = "pending"
    VALID = "valid"
    PLACEHOLDER = "placeholder"
    EXCLUDED = "excluded"

    @classmethod
    def of(cls, verdict: VerdictStatus) -> Status:
        """The outcome an evaluator's verdict designates (a scored execution is VALID)."""
        return _OF_VERDICT[verdict]


_OF_VERDICT = {VerdictStatus.SCORED: Status.VALID, VerdictStatus.PLACEHOLDER: Status.PLACEHOLDER,
               VerdictStatus.EXCLUDED: Status.EXCLUDED}  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class ExecutionOutcome:
    """One execution's closure and designated assessment."""

    execution_id: str
    status: Status
    reward: float | None = None  # required (finite) for VALID; ignored otherwise


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """How group-relative advantages are normalized."""

    scale_by_std: bool = True
    """Divide the centred reward by the group's population std (GRPO/GSPO); False: Dr.GRPO."""
    eps: float = 1e-6
    """Added to the std before dividing (keeps equal-reward groups at advantage 0)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.eps, int | float) and self.eps > 0 and math.isfinite(self.eps)):
            raise ConfigError(f"eps: {self.eps!r}; allowed a finite float > 0")


def outcome_reward(outcome: ExecutionOutcome) -> float | None:
    """The reward entering group statistics: None for EXCLUDED, 0 for a PLACEHOLDER."""
    if outcome.status is Status.EXCLUDED:
        return None
    if outcome.status is Status.PLACEHOLDER:
        return 0.0
    if outcome.status is Status.PENDING:
        raise TrainingError(f"execution {outcome.execution_id!r}: outcome is still pending")
    r = outcome.reward
    if r is None or not isinstance(r, int | float) or not math.isfinite(r):
        raise TrainingError(
            f"execution {outcome.execution_id!r}: VALID outcome needs a finite reward, got {r!r}"
        )
    return float(r)


def group_ready(outcomes: Sequence[ExecutionOutcome], group_size: int) -> bool:
    """True when all `group_size` executions are closed with a resolved designated outcome."""
    if len(outcomes) < group_size:
        return False
    return all(o.status is not Status.PENDING for o in outcomes)


def group_advantages(
    outcomes: Sequence[ExecutionOutcome], *, group_size: int, config: AdvantageConfig
) -> dict[str, float]:
    """Advantage per non-excluded execution; raises `TrainingError` if the group is not ready."""
    ids = [o.execution_id for o in outcomes]
    if len(set(ids)) != len(ids):
        raise TrainingError(f"group: duplicate execution ids in {ids}")
    if len(outcomes) != group_size:
        raise TrainingError(f"group: {len(outcomes)} outcomes; expected group_size={group_size}")
    pending = [o.execution_id for o in outcomes if o.status is Status.PENDING]
    if pending:
        raise TrainingError(f"group: not ready, executions {pending} have no resolved outcome")
    rewards = {o.execution_id: outcome_reward(o) for o in outcomes}
    kept = {k: v for k, v in rewards.items() if v is not None}
    if not kept:
        return {}
    mean = sum(kept.values()) / len(kept)
    centred = {k: v - mean for k, v in kept.items()}
    if not config.scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred.values()) / len(kept))
    return {k: c / (std + config.eps) for k, c in centred.items()}
