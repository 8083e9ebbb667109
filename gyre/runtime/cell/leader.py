"""A cell rank's loop: serves rollout through its engine, or trains its replica, as told.

The cell keeps two states in one long-lived process: the embedded engine (a child process,
`gyre.runtime.cell.engine_host.EngineHost`) and the training replica. A switch to TRAIN hands the
engine's running calls' KV to their new engines, aborts them and releases its memory; a
switch to ROLLOUT resumes the engine. A satellite's replica pulls the core's weights lazily,
at its first pass of a batch whose weight version it does not hold. Each switch reports its
measured duration; processes and communicators live across switches, only model state moves.

The leader (shard 0) of a cell's R ranks hosts the cell's first engine (a cell may serve
from several: the others on followers, `gyre.runtime.cell.serving`) and answers the coordinator's
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

from gyre.errors import TrainingError
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.cell.follower import IDLE_S, cell_engines
from gyre.runtime.cell.pace import Pace
from gyre.runtime.cell.publication import publish_parts, reload_parts
from gyre.runtime.cell.residency import TrainerResidency
from gyre.runtime.cell.serving import CellEngine
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
        cell: int | None = None,
    ) -> None:  # fmt: skip
        """`engine_index`: its engine's id; `cell`: the cell it speaks for (default the
        engine's id: one engine per cell). `clock` times this rank's start-up phases;
        `started` reports them once the engine serves (`gyre.runtime.shared.startup`)."""
        self.cfg, self.comms, self.run_dir = cfg, comms, run_dir
        self.index = engine_index if cell is None else cell
        self.clock, self.started = clock or StartupClock({}), started
        self.engine = engine
        self.served = CellEngine(cfg, index=engine_index, engine=engine, run_dir=run_dir,
                                 up=lambda m: self._up(m))  # fmt: skip
        self.trainer = (
            None if replica is None or comms is None
            else CellTrainer(cfg, replica, comms, transport, version=version, run_dir=run_dir,
                             residency=residency)
        )  # fmt: skip
        self.link: wire.Link | None = None
        self.pace = Pace.of(cfg, run_dir / "logs" / "pace" / f"cell{engine_index}.json")
        self._version = version  # > 0 after a resume
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
        url = self.served.start()
        self.clock.mark("engine ready")
        if self.version > 0:  # resumed from a checkpoint: the engine serves its weights
            self._first_weights()
            self.clock.mark("first weights")
        if self.started is not None:
            self.started()
        self.served.announce(url)
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

    def _up(self, m: msg.Message) -> None:
        assert self.link is not None
        self.link.send(m, COORDINATOR_RANK)

    def _watch_engine(self) -> None:
        self.served.watch()

    @property
    def lost_reported(self) -> bool:
        return self.served.lost_reported

    @lost_reported.setter
    def lost_reported(self, value: bool) -> None:
        self.served.lost_reported = value

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
        """Running calls' KV to their new engines first, then abort and release (§4.3);
        every engine of the cell does so on its own rank (`cell_engines`)."""
        t0 = time.perf_counter()
        self._replica()
        detail = self.served.release(m.routes, t0)
        self._trainer().to_train()
        detail |= self._cell_engines()
        self.pace.switch(to_train=True)
        self._up(msg.Switched(self.index, Role.TRAIN, time.perf_counter() - t0, detail))

    def to_rollout(self, m: msg.ToRollout) -> None:
        t0 = time.perf_counter()
        # the leader's park: the trainer's state off the GPU before the engine takes it back
        parked = self.trainer.to_rollout() if self.trainer is not None else {}
        # a satellite back after a publication it was released for (colocate) loads the
        # saved policy; the core's replica holds the weights: its ranks send them
        self.served.resume(m.published, latest=not self.core)
        if self.core:
            self._reload(m.published)
        self.pace.switch(to_train=False)
        detail = {"engine_version": self.engine.version,  # the weights it serves from now on
                  **parked, **self._cell_engines()}  # fmt: skip
        self._up(msg.Switched(self.index, Role.ROLLOUT, time.perf_counter() - t0, detail))

    def _cell_engines(self) -> dict[str, Any]:
        """Every engine of the cell after a switch (`cell_engines`: collective over the cell)."""
        if self.comms is None or self.trainer is None:
            return {}
        return cell_engines(self.comms, self.served, self.cfg.engines_per_cell)

    def _reload(self, published: int) -> None:
        """Collective over the cell: its engine, if alive and behind `published`, gets the
        weights the cell holds from the ranks that hold them (`reload_parts`: a Megatron
        stage's from its sender); should that miss, the newest saved policy."""
        t, engine = self._trainer(), self.engine
        behind = engine.dead() is None and not engine.released and engine.version < published
        targets = [(self.served.index, engine.url)] if behind else []
        missed = reload_parts(t.comms.cell, lambda: t.replica.part(t.comms.shard), targets,
                              t.version, self.cfg.engine, engine.host)  # fmt: skip
        if behind and not missed:
            engine.version = t.version
        elif missed:
            self.served.call(self.served.load_latest)

    # ------------------------------------------------------------------ training

    def prepass(self, m: msg.Prepass) -> None:
        t0 = time.perf_counter()
        sums = self._trainer().prepass(m)
        self.pace.train_pass(m.steps, prepass=True)
        assert sums is not None  # the leader holds the cell's sums
        indices = tuple(step.index for step in m.steps)
        self._up(msg.Prepassed(self.index, m.batch, indices, tuple(sums),
                               time.perf_counter() - t0))  # fmt: skip

    def accumulate(self, m: msg.Accumulate) -> None:
        t0 = time.perf_counter()
        stats = self._trainer().accumulate(m)
        self.pace.train_pass(m.steps, prepass=False)
        assert stats is not None
        indices = tuple(step.index for step in m.steps)
        self._up(msg.Accumulated(self.index, m.batch, indices, stats.objective,
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
        them reload. Every rank of the cell takes part: each writes and sends the weights it
        holds (`Replica.part`: a Megatron stage's from that stage's ranks), the policy as a
        file of its own (`policies.save_parts`), the publication by its own route
        (`gyre.runtime.cell.publication`).
        """
        t0 = time.perf_counter()
        comms = self._trainer().comms
        part = self._replica().part(comms.shard)  # saved and sent by the ranks that hold it
        self._save(policies.version_name(m.version), part, keep=self.cfg.train.keep_policies)
        missed = publish_parts(comms.cell, part, m.targets, m.version, self.cfg.engine,
                               self.engine.host)  # fmt: skip
        assert missed is not None  # the leader's answer
        self.pace.hold(self.cfg.pace.costs.publish_s)
        self._up(msg.Published(m.version, time.perf_counter() - t0, missed))

    def save_policy(self, m: msg.SavePolicy) -> None:
        """Core: keep the weights as policy `m.name` (every rank of the cell writes its part)."""
        path = self._save(m.name, self._replica().part(self._trainer().comms.shard), keep=None)
        self._up(msg.PolicySaved(self.version, str(path)))

    def _save(self, name: str, part: list[tuple[str, torch.Tensor]] | None,
              keep: int | None) -> Path:  # fmt: skip
        """The policy directory `name`, each part written by the rank that holds it
        (`policies.save_parts`, collective over the cell)."""
        replica = self._replica()
        config, generation = replica.policy_configs()
        path = policies.save_parts(self._trainer().comms.cell, part, self.run_dir, name,
                                   version=self.version, config=config,
                                   tokenizer=replica.tokenizer, generation=generation,
                                   keep=keep)  # fmt: skip
        assert path is not None  # the leader's
        return path

    # ------------------------------------------------------------------ engine loss

    def respawn(self, m: msg.Respawn) -> None:
        """Restart a lost engine with the newest policy a publication saved
        (`CellEngine.respawn`)."""
        self.served.respawn(m.role)

    def reload(self, m: msg.Reload) -> None:
        """Load the latest policy if this engine missed it (a failed push)."""
        self.served.reload()

    # ------------------------------------------------------------------ checkpoints

    def _first_weights(self) -> None:
        """After a resume: a cell's engine gets the checkpoint's weights from the cell's
        ranks (`reload_parts`, collective over the cell); a standalone engine reads them."""
        if self.trainer is not None:
            self._reload(self.version)
            return
        named = checkpoint.load_weights(self.run_dir)  # no optimizer state read
        assert named is not None, "a resumed standalone engine needs a checkpoint"
        self.engine.load_weights(named, self.version)

    def save_checkpoint(self, m: msg.SaveCheckpoint) -> None:
        """Core: weights + optimizer state into the checkpoint directory being written."""
        t0 = time.perf_counter()
        size = self._trainer().save_checkpoint(m)
        self._up(msg.Checkpointed(self.version, m.folder, size, time.perf_counter() - t0))
