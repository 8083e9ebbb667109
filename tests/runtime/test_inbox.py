"""The coordinator's bounded waits (`gyre.runtime.coordinator.inbox`): a closing drain that
hears nothing gives up at its timeout (the run finishes), one that awaits a message names
it, and a world quiet for `timeouts.stall_s` is stalled. The link is a silent transport:
`recv` waits out its timeout and brings nothing, as an MPI link with no sender does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gyre.runtime.coordinator.inbox import Inbox
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import wire
from gyre.runtime.shared.config import TimeoutsConfig


class Silent:
    def recv(self, timeout: float | None = None) -> None:
        time.sleep(timeout or 0.0)


def _inbox(tmp_path: Path, stall_s: float) -> Inbox:
    timeouts = TimeoutsConfig(stall_s=stall_s, drain_s=0.3)
    return Inbox(Silent(), timeouts, tmp_path, handle=lambda m: None,  # type: ignore[arg-type]
                 where=lambda: "closing")  # fmt: skip


def test_a_quiet_drain_gives_up_at_its_timeout(tmp_path: Path) -> None:
    """Executions still being evaluated at the end (a judge retrying, say) send nothing for
    the drain's whole timeout: the drain returns then, it does not fail the finished run."""
    t0 = time.monotonic()
    _inbox(tmp_path, stall_s=30).drain_until(lambda: False, (), timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 5


def test_an_awaited_message_that_never_comes_is_named(tmp_path: Path) -> None:
    with pytest.raises(wire.RuntimeFailure, match="no PolicySaved within 0s"):
        _inbox(tmp_path, stall_s=30).drain_until(lambda: False, (), timeout=0.3,
                                                 awaited=msg.PolicySaved)  # fmt: skip


def test_a_world_quiet_past_stall_s_is_stalled(tmp_path: Path) -> None:
    with pytest.raises(wire.RuntimeFailure, match=r"no progress for \d+s \(closing\)"):
        _inbox(tmp_path, stall_s=0.2).drain_until(lambda: False, (), timeout=1)
