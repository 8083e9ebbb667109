"""An execution's lifecycle records keep what Gyre has always written: a checkpoint's
`state.json`, the step metrics' names (docs/runtime.md), and close statuses read back."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gyre.runtime.coordinator.progress import StepMetrics
from gyre.runtime.shared import checkpoint
from gyre.runtime.shared.checkpoint import CheckpointState
from gyre.vocabulary import CloseStatus

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def test_checkpoint_state_writes_and_reads_back_the_same_json(tmp_path: Path) -> None:
    state = CheckpointState(version=3, updates=2, trained=("g0", "g1"), next_group=4, t=5.0)
    folder = checkpoint.begin(tmp_path, state.version)
    final = checkpoint.commit(tmp_path, folder, state, keep=2)
    written = json.loads((final / checkpoint.STATE).read_text())
    assert written == {"version": 3, "updates": 2, "trained": ["g0", "g1"], "next_group": 4,
                       "t": 5.0}  # fmt: skip
    found = checkpoint.latest(tmp_path)
    assert found is not None and found[0] == final
    assert CheckpointState.of(found[1]) == state


def test_step_metrics_are_the_documented_steps_rows() -> None:
    text = DOCS.read_text()
    paragraph = text[
        text.index("Step metrics (`steps` table") : text.index("A step whose gradient")
    ]
    named = re.findall(r"`([a-z_]+)`", paragraph)[1:]  # after `steps` itself
    documented = [n for n in named if n != "token_budget"]  # a config key the text mentions
    metrics = StepMetrics(**{name: float(i) for i, name in enumerate(documented)})
    assert list(metrics.to_row()) == documented


def test_close_statuses_read_back_from_their_persisted_strings() -> None:
    for status in CloseStatus:
        assert CloseStatus(status.value) is status
