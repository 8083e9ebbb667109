"""The shared vocabulary keeps the strings Gyre writes into traces, journals and JSON files."""

from __future__ import annotations

import pytest

from gyre.train.rewards import Status
from gyre.vocabulary import CloseStatus, EngineId, Outcome, Role, VerdictStatus


def test_values_are_the_persisted_strings() -> None:
    assert [o.value for o in Outcome] == ["completed", "failed", "timed_out", "cancelled"]
    assert [v.value for v in VerdictStatus] == ["scored", "excluded", "placeholder"]
    assert [r.value for r in Role] == ["rollout", "to_train", "train", "to_rollout"]
    assert [c.value for c in CloseStatus] == ["completed", "failed", "timed_out", "cancelled",
                                              "not_launched", "unrecoverable", "recovered"]  # fmt: skip


def test_a_harness_outcome_closes_as_its_own_status() -> None:
    assert {o: CloseStatus.of(o).value for o in Outcome} == {o: o.value for o in Outcome}


@pytest.mark.parametrize("index", [0, 3, 17])
def test_engine_id_reads_back_its_string(index: int) -> None:
    assert str(EngineId(index)) == f"e{index}"
    assert EngineId.parse(str(EngineId(index))) == EngineId(index)


@pytest.mark.parametrize("text", ["", "e", "3", "x3", "e-1", "e3a", "hang"])
def test_engine_id_rejects_other_names(text: str) -> None:
    with pytest.raises(ValueError, match="engine id"):
        EngineId.parse(text)


def test_every_verdict_designates_a_training_outcome() -> None:
    assert {v: Status.of(v) for v in VerdictStatus} == {
        VerdictStatus.SCORED: Status.VALID,
        VerdictStatus.PLACEHOLDER: Status.PLACEHOLDER,
        VerdictStatus.EXCLUDED: Status.EXCLUDED,
    }
