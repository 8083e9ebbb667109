"""The coordinator's inbox: the next message from any rank, every wait bounded.

Whatever the coordinator waits for — the ranks at start-up, the next report while the run
goes, a checkpoint to commit, the executions to close at the end — it waits here, for at
most a timeout. A run that has heard nothing for `timeouts.stall_s` is stalled: it fails
with a message naming where it stands (`where`), instead of hanging a cluster allocation.

    inbox = Inbox(link, cfg.timeouts, run_dir, handle=coordinator.handle, where=...)
    m = inbox.next(1.0, stall_ok=True)  # None: nothing yet, and not stalled
    inbox.drain_until(lambda: not ledger.live(), (msg.Assessed, ...), timeouts.drain_s)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import wire
from gyre.runtime.shared.config import TimeoutsConfig

# what a wait for one message handles meanwhile: executions' reports, restarts, saved policies
REPORTS = (msg.HarnessEnded, msg.Assessed, msg.JournalNode, msg.EngineReady, msg.PolicySaved,
           msg.StartupTimes, msg.Evaluated, msg.JudgeReady)  # fmt: skip
# ... and while a checkpoint commits or the run's executions close (every report still
# counts then: an engine restarted before the last update may report back during the close)
CLOSING = (*REPORTS, msg.Checkpointed)


class Inbox:
    """Messages from `link`; `handle` carries one out, `where` says where the run stands."""

    def __init__(
        self, link: wire.Link, timeouts: TimeoutsConfig, run_dir: Path,
        handle: Callable[[msg.Message], None], where: Callable[[], str],
    ) -> None:  # fmt: skip
        self.link, self.timeouts, self.run_dir = link, timeouts, run_dir
        self.handle, self.where = handle, where
        self.last_message = time.monotonic()

    def next(self, timeout: float | None = None, stall_ok: bool = False) -> msg.Message | None:
        """The next message; None after `timeout` when `stall_ok` and the run is not stalled."""
        stall_s = self.timeouts.stall_s
        m = self.link.recv(timeout=stall_s if timeout is None else timeout)
        if m is not None:
            self.last_message = time.monotonic()
            return m
        quiet = time.monotonic() - self.last_message
        if stall_ok and quiet < stall_s:
            return None
        raise wire.RuntimeFailure(
            f"no progress for {quiet:.0f}s ({self.where()}); see the logs in {self.run_dir}"
        )

    def drain_until(
        self, done: Callable[[], bool], handled: tuple[type[msg.Message], ...], timeout: float,
        awaited: type[msg.Message] | None = None,
    ) -> None:  # fmt: skip
        """Handle the `handled` messages (others are dropped) until `done()`; after `timeout`
        seconds give up, or fail naming the `awaited` message if one is."""
        deadline = time.time() + timeout
        while not done():
            if time.time() > deadline:
                if awaited is None:
                    return
                raise wire.RuntimeFailure(f"no {awaited.__name__} within {timeout:.0f}s")
            m = self.next(max(0.1, deadline - time.time()), stall_ok=True)  # quiet: re-check
            if isinstance(m, handled):
                self.handle(m)
