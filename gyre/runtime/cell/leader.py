"""A cell rank's loop: serves rollout through its engine, or trains its replica, as told.

The cell keeps two states in one long-lived process: the embedded engine (a child process,
`gyre.runtime.cell.engine_host.EngineHost`) and the training replica. A switch to TRAIN hands the
engine's running calls' KV to their new engines, aborts them and releases its memory; a
switch to ROLLOUT resumes the engine. A satellite's replica pulls the core's weights lazily,
at its first pass of a batch whose weight version it does not hold. Each switch reports its
measured duration; processes and communicators live across switches, only model state moves.

The leader (shard 0) of a cell's R ranks hosts the engine and answers the coordinator's
messages (`gyre.runtime.shared.messages`, one handler per type); its training work, and that of the
other ranks (`gyre.runtime.cell.follower`), is `gyre.runtime.cell.trainer.CellTrainer`. A
standalone engine rank runs this loop without a replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gyre.errors import EngineError, TrainingError
from gyre.rollout.kvmigrate import execution_prefix, migrate_kv
from gyre.runtime.cell.engine_host import EngineHost, publish
from gyre.runtime.cell.follower import IDLE_S
from gyre.runtime.cell.pace import Pace
from gyre.runtime.cell.residency import TrainerResidency
from gyre.runtime.cell.trainer import CellTrainer
from gyre.runtime.shared import checkpoint, policies, wire
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import RunConfig
from gyre.runtime.shared.layout import COORDINATOR_RANK
from gyre.runtime.shared.startup import StartupClock
from gyre.train.backends import Replica
from gyre.train.comm import Communicators
from gyre.vocabulary import Role


class CellProcess:
    """The loop of one cell (or standalone engine) rank."""

    def __init__(
        self, cfg: RunConfig, *, engine_index: int, comms: Communicators | None, run_dir: Path,
        engine: EngineHost, replica: Replica | None = None, transport: Any = None,
        version: int = 0, residency: TrainerResidency | None = None,
        clock: StartupClock | None = None, started: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """`clock` times this rank's start-up phases; `started` reports them once the
        engine serves (`gyre.runtime.shared.startup`)."""
        self.cfg, self.index, self.comms, self.run_dir = cfg, engine_index, comms, run_dir
        self.clock, self.started = clock or StartupClock({}), started
        self.engine = engine
        self.trainer = (
            None if replica is None or comms is None
            else CellTrainer(cfg, replica, comms, transport, version=version, run_dir=run_dir,
                             residency=residency)
        )  # fmt: skip
        self.link: wire.Link | None = None
        self.pace = Pace.of(cfg, run_dir / "logs" / "pace" / f"cell{engine_index}.json")
        self._version = version  # > 0 after a resume
        self.lost_reported = False
        self.handlers: dict[type, Callable[[Any], None]] = {
            msg.ToTrain: self.to_train, msg.ToRollout: self.to_rollout,
            msg.Prepass: self.prepass, msg.Accumulate: self.accumulate, msg.Reduce: self.reduce,
            msg.Publish: self.publish, msg.SavePolicy: self.save_policy,
            msg.Respawn: self.respawn, msg.Reload: self.reload,
            msg.SaveCheckpoint: self.save_checkpoint,
        }  # fmt: skip

    @property
    def core(self) -> bool:
        return self.index == 0

    # ------------------------------------------------------------------ loop

    def serve(self, link: wire.Link) -> int:
        """Report the engine, then obey messages until `Stop`; returns the stop status."""
        self.link = link
        url = self._start_engine()
        self.clock.mark("engine ready")
        if self.version > 0:  # resumed from a checkpoint: the engine serves its weights
            self.engine.load_weights(self._checkpoint_weights(), self.version)
            self.clock.mark("first weights")
        if self.started is not None:
            self.started()
        self._up(msg.EngineReady(self.index, url, self.engine.version))
        while True:
            self._watch_engine()
            if self.trainer is not None:
                self.trainer.idle()
            m = link.recv(timeout=IDLE_S)  # a blocked wait; wakes to watch the engine
            if m is None:
                continue
            if isinstance(m, msg.Stop):
                self.engine.stop()
                return m.status
            self.pace.begin()
            self.handlers[type(m)](m)

    def _start_engine(self, tries: int = 3) -> str:
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

    def _up(self, m: msg.Message) -> None:
        assert self.link is not None
        self.link.send(m, COORDINATOR_RANK)

    def _watch_engine(self) -> None:
        rc = self.engine.dead()
        if rc is not None and not self.lost_reported:
            self.lost_reported = True
            self._up(msg.EngineLost(self.index, rc))

    def _trainer(self) -> CellTrainer:
        if self.trainer is None:
            raise TrainingError(f"engine {self.index}: a standalone engine cannot train")
        return self.trainer

    def _replica(self) -> Replica:
        return self._trainer().replica

    @property
    def replica(self) -> Replica | None:
        """This rank's training replica (None on a standalone engine)."""
        return self.trainer.replica if self.trainer is not None else None

    @property
    def version(self) -> int:
        """Version of the weights this rank holds (the replica's; a standalone: its start)."""
        return self.trainer.version if self.trainer is not None else self._version

    # ------------------------------------------------------------------ role switches

    def to_train(self, m: msg.ToTrain) -> None:
        """Running calls' KV to their new engines first, then abort and release (§4.3)."""
        t0 = time.perf_counter()
        self._replica()
        detail: dict[str, Any] = {}

        def switch() -> None:
            if m.routes:  # never fatal: a failed handoff means the new engine recomputes
                moved = migrate_kv(self.engine.url,
                                   {execution_prefix(e): u for e, u in m.routes.items()},
                                   timeout=30)  # fmt: skip
                detail["kv_migrated"] = sum(1 for r in moved.values() if r.outcome == "migrated")
                detail["kv_tokens"] = sum(r.tokens for r in moved.values())
                detail["kv_s"] = time.perf_counter() - t0
            self.engine.release()

        self._engine_call(switch)
        self._trainer().to_train()
        self.pace.switch(to_train=True)
        self._up(msg.Switched(self.index, Role.TRAIN, time.perf_counter() - t0, detail))

    def to_rollout(self, m: msg.ToRollout) -> None:
        t0 = time.perf_counter()
        # the leader's park: the trainer's state off the GPU before the engine takes it back
        parked = self.trainer.to_rollout() if self.trainer is not None else {}

        def restore() -> None:
            self.engine.resume()
            if self.engine.version >= m.published:
                return
            if self.core:  # the core after a publication: its replica holds those weights
                self.engine.load_weights(self._named(), self.version)
            else:  # a satellite back after a publication it was released for (colocate)
                self._load_latest()

        self._engine_call(restore)
        self.pace.switch(to_train=False)
        detail = {"engine_version": self.engine.version,  # the weights it serves from now on
                  **parked}  # fmt: skip
        self._up(msg.Switched(self.index, Role.ROLLOUT, time.perf_counter() - t0, detail))

    def _engine_call(self, call: Callable[[], None]) -> None:
        """Run a switch's engine step unless the engine is dead or dies during it.

        A lost engine is reported by the watch and restarted in the role the cell then
        has, so the switch itself goes on without it.
        """
        if self.engine.dead() is not None:
            return
        try:
            call()
        except EngineError:
            if self.engine.dead() is None:
                time.sleep(0.5)  # a killed process may not be reaped yet
            if self.engine.dead() is None:
                raise

    # ------------------------------------------------------------------ training

    def prepass(self, m: msg.Prepass) -> None:
        t0 = time.perf_counter()
        sums = self._trainer().prepass(m)
        self.pace.train_pass(m.batch, m.step, prepass=True)
        assert sums is not None  # the leader holds the cell's sums
        self._up(msg.Prepassed(self.index, m.batch, m.step.index, sums, time.perf_counter() - t0))

    def accumulate(self, m: msg.Accumulate) -> None:
        t0 = time.perf_counter()
        stats = self._trainer().accumulate(m)
        self.pace.train_pass(m.batch, m.step, prepass=False)
        assert stats is not None
        self._up(msg.Accumulated(self.index, m.batch, m.step.index, stats.objective,
                                 stats.targets, time.perf_counter() - t0))  # fmt: skip

    def reduce(self, m: msg.Reduce) -> None:
        t0 = time.perf_counter()
        norm = self._trainer().reduce(m)
        self.pace.hold(self.cfg.pace.costs.update_s)
        self._up(msg.Updated(self.index, m.batch, norm, time.perf_counter() - t0))

    def publish(self, m: msg.Publish) -> None:
        """Core: keep the policy, then push it to every rollout engine.

        The policy directory is written first, so an engine that dies around the
        publication (its push fails, or it restarts before it) loads this version when it
        comes back. Engines whose push failed are reported, never fatal: the coordinator has
        them reload. The weights go as HTTP bodies to each engine, or through one update
        group per publication broadcast to all (`engine.publication`, by size when auto).
        """
        t0 = time.perf_counter()
        self._save(policies.version_name(m.version), keep=self.cfg.train.keep_policies)
        missed = publish(m.targets, self._named(), m.version, self.cfg.engine, self.engine.host)
        self.pace.hold(self.cfg.pace.costs.publish_s)
        self._up(msg.Published(m.version, time.perf_counter() - t0, missed))

    def save_policy(self, m: msg.SavePolicy) -> None:
        path = self._save(m.name, keep=None)
        self._up(msg.PolicySaved(self.version, str(path)))

    def _save(self, name: str, keep: int | None) -> Path:
        replica = self._replica()
        return policies.save_policy(self.run_dir, name, replica.policy_model, replica.tokenizer,
                                    version=self.version, keep=keep)  # fmt: skip

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return self._replica().named()

    # ------------------------------------------------------------------ engine loss

    def respawn(self, m: msg.Respawn) -> None:
        """Restart a lost engine with the latest policy; released again if the cell trains.

        A new engine process holds the base model, whatever version its predecessor served:
        it is started as version 0 and brought to the newest weights this rank can reach —
        its replica's (a cell's weights are those of the version it last published or
        pulled) or the newest policy a publication saved. (Started at the old version, an
        engine that had loaded version v came back with the base weights reporting v.)
        """
        self.engine.stop()
        self.engine.version = 0
        self.engine.spawn()
        url = self._start_engine()
        if self.trainer is not None and self.version > 0:
            self.engine.load_weights(self._named(), self.version)
        self._load_latest()
        if m.role is not Role.ROLLOUT:
            self.engine.release()
        self.lost_reported = False
        self._up(msg.EngineReady(self.index, url, self.engine.version))

    def reload(self, m: msg.Reload) -> None:
        """Load the latest policy if this engine missed it (a failed push).

        A dead engine is left alone (its restart loads it); a released one is too (its return
        to rollout, or the next publication, brings it up to date).
        """
        if self.engine.dead() is None and not self.engine.released:
            self._engine_call(self._load_latest)

    def _load_latest(self) -> None:
        kept = policies.latest(self.run_dir)
        if kept is not None and kept[0] > self.engine.version:
            self.engine.load_weights(policies.load_weights(kept[1]), kept[0])

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_weights(self) -> list[tuple[str, torch.Tensor]]:
        if self.trainer is not None:
            return self._named()
        data = checkpoint.load_core(self.run_dir)
        assert data is not None, "a resumed standalone engine needs a checkpoint"
        return list(data["named"])

    def save_checkpoint(self, m: msg.SaveCheckpoint) -> None:
        """Core: weights + optimizer state into the checkpoint directory being written."""
        t0 = time.perf_counter()
        size = self._trainer().save_checkpoint(m)
        self._up(msg.Checkpointed(self.version, m.folder, size, time.perf_counter() - t0))
