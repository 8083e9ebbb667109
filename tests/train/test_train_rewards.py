"""Group readiness and group-relative advantages against a direct formula."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.errors import ConfigError, TrainingError
from gyre.train.rewards import (
    AdvantageConfig,
    ExecutionOutcome,
    Status,
    group_advantages,
    group_ready,
)


def _valid(i: int, r: float) -> ExecutionOutcome:
    return ExecutionOutcome(execution_id=f"e{i}", status=Status.VALID, reward=r)


@given(st.lists(st.floats(-10, 10), min_size=1, max_size=12), st.booleans())
def test_advantages_match_formula(rewards: list[float], scale: bool) -> None:
    outs = [_valid(i, r) for i, r in enumerate(rewards)]
    cfg = AdvantageConfig(scale_by_std=scale)
    adv = group_advantages(outs, group_size=len(outs), config=cfg)
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    for i, r in enumerate(rewards):
        want = (r - mean) / (std + cfg.eps) if scale else r - mean
        assert adv[f"e{i}"] == pytest.approx(want, abs=1e-9)
    assert abs(sum(adv.values())) < 1e-6 * n * (1 + max(abs(v) for v in adv.values()))


def test_placeholder_counts_as_zero_and_excluded_is_dropped() -> None:
    outs = [
        _valid(0, 1.0),
        _valid(1, 0.0),  # a valid zero is a real reward
        ExecutionOutcome(execution_id="e2", status=Status.PLACEHOLDER),
        ExecutionOutcome(execution_id="e3", status=Status.EXCLUDED),
    ]
    adv = group_advantages(outs, group_size=4, config=AdvantageConfig(scale_by_std=False))
    assert set(adv) == {"e0", "e1", "e2"}
    assert adv["e0"] == pytest.approx(1 - 1 / 3) and adv["e2"] == pytest.approx(-1 / 3)


def test_readiness_needs_all_executions_resolved() -> None:
    outs = [_valid(0, 1.0), ExecutionOutcome(execution_id="e1", status=Status.PENDING)]
    assert not group_ready(outs, 2)
    assert not group_ready(outs[:1], 2)
    assert group_ready([_valid(0, 1.0), _valid(1, 0.0)], 2)
    with pytest.raises(TrainingError, match="not ready"):
        group_advantages(outs, group_size=2, config=AdvantageConfig())


@pytest.mark.parametrize("reward", [None, float("nan"), float("inf")])
def test_valid_outcome_without_finite_reward_is_an_error(reward: float | None) -> None:
    outs = [_valid(0, 1.0), ExecutionOutcome(execution_id="e1", status=Status.VALID, reward=reward)]
    with pytest.raises(TrainingError, match="e1"):
        group_advantages(outs, group_size=2, config=AdvantageConfig())


def test_wrong_group_size_duplicates_and_config() -> None:
    with pytest.raises(TrainingError, match="group_size"):
        group_advantages([_valid(0, 1.0)], group_size=2, config=AdvantageConfig())
    with pytest.raises(TrainingError, match="duplicate"):
        group_advantages([_valid(0, 1.0), _valid(0, 2.0)], group_size=2, config=AdvantageConfig())
    with pytest.raises(ConfigError, match="eps"):
        AdvantageConfig(eps=0)
