"""One rollout engine a cell rank hosts, and what the rank does with it on each message.

A cell serves from `RunConfig.engines_per_cell` engines, engine j on its rank
j x tensor_parallel x nodes (`gyre.runtime.shared.layout.engine_shards`): the leader hosts
engine 0 (`gyre.runtime.cell.leader`), followers the others (`gyre.runtime.cell.follower`).
Each such rank holds one `CellEngine`: it waits for the child process to serve, reports it
ready (`EngineReady`) and lost (`EngineLost`) under its own engine id, releases it on the
switch to training (after handing its running calls' KV to their new engines), resumes it
on the way back (bringing it to the newest policy), restarts it on `Respawn` and reloads it
on `Reload`. The coordinator sends a cell's role switches to every rank of the cell, so every
engine of the cell is released and resumed with it; the leader alone answers (`Switched`).

    served = CellEngine(cfg, index=3, engine=host, run_dir=run_dir, up=send_to_coordinator)
    url = served.start(); served.announce(url)
    served.release(routes)        # ToTrain
    served.resume(published)      # ToRollout: the newest saved policy if behind
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gyre.errors import EngineError
from gyre.rollout.kvmigrate import execution_prefix, migrate_kv
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import policies
from gyre.runtime.shared.config import RunConfig
from gyre.vocabulary import Role

Named = list[tuple[str, torch.Tensor]]


class CellEngine:
    """Engine `index` (its id in the fleet) as its host rank drives it."""

    def __init__(
        self, cfg: RunConfig, *, index: int, engine: EngineHost, run_dir: Path,
        up: Callable[[msg.Message], None],
    ) -> None:  # fmt: skip
        self.cfg, self.index, self.engine, self.run_dir, self.up = cfg, index, engine, run_dir, up
        self.lost_reported = False

    def start(self, tries: int = 3) -> str:
        """Wait for the engine; one that dies while starting (SIGKILL, OOM) is started again.

        Only a start that fails `tries` times in a row (a broken model or environment, not
        a lost process) fails the job, with the engine's own log tail.
        """
        for attempt in range(1, tries + 1):
            try:
                return self.engine.wait_ready(self.cfg.timeouts.startup_s)
            except EngineError:
                if attempt == tries or self.engine.dead() is None:
                    raise  # hung rather than died, or died every time
                self.engine.stop()
                self.engine.spawn()
        raise AssertionError("unreachable")

    def announce(self, url: str) -> None:
        self.up(msg.EngineReady(self.index, url, self.engine.version))

    def watch(self) -> None:
        """Report the engine's loss once (the coordinator has it respawned)."""
        rc = self.engine.dead()
        if rc is not None and not self.lost_reported:
            self.lost_reported = True
            self.up(msg.EngineLost(self.index, rc))

    def release(self, routes: dict[str, str], t0: float) -> dict[str, Any]:
        """ToTrain: running calls' KV to their new engines (those this engine holds), then
        abort and release (§4.3). Returns what the switch records of the handoff."""
        detail: dict[str, Any] = {}

        def switch() -> None:
            if routes:  # never fatal: a failed handoff means the new engine recomputes
                moved = migrate_kv(self.engine.url,
                                   {execution_prefix(e): u for e, u in routes.items()},
                                   timeout=30)  # fmt: skip
                detail["kv_migrated"] = sum(1 for r in moved.values() if r.outcome == "migrated")
                detail["kv_tokens"] = sum(r.tokens for r in moved.values())
                detail["kv_s"] = time.perf_counter() - t0
            self.engine.release()

        self.call(switch)
        return detail

    def resume(self, published: int, latest: bool = True) -> None:
        """ToRollout: resume; an engine older than `published` loads the newest saved policy
        (`latest`; the core's leader instead has its cell's ranks send their weights:
        `gyre.runtime.cell.publication.reload_parts`)."""

        def restore() -> None:
            self.engine.resume()
            if latest and self.engine.version < published:  # back after a publication
                self.load_latest()

        self.call(restore)

    def call(self, step: Callable[[], None]) -> None:
        """Run a switch's engine step unless the engine is dead or dies during it.

        A lost engine is reported by the watch and restarted in the role the cell then
        has, so the switch itself goes on without it.
        """
        if self.engine.dead() is not None:
            return
        try:
            step()
        except EngineError:
            if self.engine.dead() is None:
                time.sleep(0.5)  # a killed process may not be reaped yet
            if self.engine.dead() is None:
                raise

    def respawn(self, role: Role) -> None:
        """Restart a lost engine with the newest policy a publication saved; released again
        if the cell trains.

        A new engine process holds the base model, whatever version its predecessor served:
        it is started as version 0 and brought to the newest saved policy (the version the
        rollout engines serve; a cell's replica may hold a newer, unpublished one). (Started
        at the old version, an engine that had loaded version v came back with the base
        weights reporting v.)
        """
        self.engine.stop()
        self.engine.version = 0
        self.engine.spawn()
        url = self.start()
        self.load_latest()
        if role is not Role.ROLLOUT:
            self.engine.release()
        self.lost_reported = False
        self.announce(url)

    def reload(self) -> None:
        """Load the latest policy if this engine missed it (a failed push).

        A dead engine is left alone (its restart loads it); a released one is too (its return
        to rollout, or the next publication, brings it up to date).
        """
        if self.engine.dead() is None and not self.engine.released:
            self.call(self.load_latest)

    def load_latest(self) -> None:
        kept = policies.latest(self.run_dir)
        if kept is not None and kept[0] > self.engine.version:
            self.engine.load_weights(policies.load_weights(kept[1]), kept[0])
