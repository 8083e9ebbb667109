"""A cell rank: serves rollout through its engine, or trains its replica, as told.

The cell keeps two states in one long-lived process: the embedded engine (a child process,
`gyre.runtime.engine_host.EngineHost`) and the training replica (`gyre.train.cell.TorchCell`;
on the core also the optimizer). A switch to TRAIN aborts the engine's outstanding calls and
releases its memory; a switch to ROLLOUT resumes the engine. A satellite's replica pulls the
core's weights lazily, at its first pass of a batch whose weight version it does not hold:
the core's weights are fixed while any pass is outstanding, so a pull never sees an update
half done.
Each switch reports its measured duration. Processes and communicators live across
switches; only model state moves.

A cell is R ranks on its cell communicator (`topology.ranks_per_cell`). Its leader (shard 0)
hosts the engine and answers the coordinator's messages (`gyre.runtime.messages`, one
handler per type): ToTrain, ToRollout, Prepass, Accumulate, Reduce, Publish, SavePolicy,
Respawn, Reload, SaveCheckpoint, Stop. The other ranks (`CellFollower`) take their share of
every training pass and update (`CellTrainer`, the one implementation of a rank's training
work). A standalone engine rank runs the leader's loop without a replica.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gyre.errors import EngineError, TrainingError
from gyre.rollout.kvmigrate import execution_prefix, migrate_kv
from gyre.rollout.pacing import Pacer
from gyre.runtime import audit, checkpoint, policies, wire
from gyre.runtime import messages as msg
from gyre.runtime.config import RunConfig
from gyre.runtime.engine_host import EngineHost, push_weights, push_weights_distributed
from gyre.runtime.layout import COORDINATOR_RANK
from gyre.runtime.replica import Replica
from gyre.runtime.residency import TrainerResidency
from gyre.schedule.devices import PaceConfig
from gyre.train.cell import StepStats
from gyre.train.comm import (
    Communicators,
    arrive,
    broadcast_from_core,
    broadcast_in_cell,
    reduce_to_core,
    sum_in_cell,
)
from gyre.train.objective import batch_gradient
from gyre.train.packing import MicroStep
from gyre.vocabulary import Role

IDLE_S = 0.05
"""How long a cell rank waits for a message before it watches its engine and, on the core,
serves snapshot pulls (`CellTrainer.idle`)."""


def share(step: MicroStep, shard: int, ranks: int) -> MicroStep:
    """Rank `shard`'s rows of a micro-step split over a cell's `ranks` ranks.

    Rows are ordered longest first, so striding gives every rank a similar load; a rank
    left without rows (a step with fewer rows than ranks) does no pass for it.
    """
    return dataclasses.replace(step, rows=step.rows[shard::ranks])


class Pace:
    """A cell's device work held to the modelled cluster's time (`pace:`, docs/pacing.md).

    Each message's work is timed from `begin` (the message's arrival): a role switch, a
    training pass (the first of a batch on this cell also fills the pipeline), the update, a
    publication. Unpaced (`pace.scale` 0), every call returns at once.
    """

    def __init__(self, cfg: PaceConfig, pacer: Pacer | None) -> None:
        self.cfg, self.pacer = cfg, pacer
        self.began = time.monotonic()
        self.filled: set[int] = set()  # batches whose pipeline this cell has filled

    @classmethod
    def of(cls, cfg: RunConfig, report: Path) -> Pace:
        if not cfg.pace.enabled:
            return cls(cfg.pace, None)
        report.parent.mkdir(parents=True, exist_ok=True)
        return cls(cfg.pace, Pacer(cfg.pace.scale, report))

    def begin(self) -> None:
        self.began = time.monotonic()

    def hold(self, modelled_s: float) -> None:
        if self.pacer is not None:
            self.pacer.hold(modelled_s, self.began)

    def switch(self, *, to_train: bool) -> None:
        self.hold(self.cfg.costs.switch_s(to_train))

    def train_pass(self, batch: int, step: MicroStep, *, prepass: bool) -> None:
        tokens = sum(row.length for row in step.rows)
        seconds = self.cfg.costs.pass_s(tokens, self.cfg.nodes_per_cell, prepass=prepass)
        if batch not in self.filled:
            self.filled.add(batch)
            seconds += self.cfg.costs.pipeline_fill_s
        self.hold(seconds)


class CellTrainer:
    """One rank's part of its cell's training replica (`gyre.runtime.replica`).

    Data parallel inside the cell (the torch backend, `dims.splits_rows`): every rank holds
    the whole model, each pass's rows are split over the cell's ranks, whose results the
    leader (shard 0) gathers and reports; an update sums gradients over the prefix
    communicator at every shard position, then inside the core cell, steps the optimizer on
    the core's leader and broadcasts back the same way. Model parallel (the Megatron
    backend): every rank runs every row on its shard (the leader reports its own results,
    the same on every rank), the prefix sums are per shard, and every core rank steps its
    shard. With one rank per cell every collective inside the cell is a no-op and this is
    the single-rank cell.
    """

    def __init__(
        self, cfg: RunConfig, replica: Replica, comms: Communicators, transport: Any, *,
        version: int, run_dir: Path, residency: TrainerResidency | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.replica, self.comms, self.transport = cfg, replica, comms, transport
        self.version = version  # of the weights held (> 0 after a resume)
        self.run_dir = run_dir
        self.ranks = comms.cell.Get_size()
        self.residency = residency  # a trainer sharing its GPU with the engine (placement)
        if residency is not None:  # cells start in rollout: the engine has the GPU
            residency.release(replica.cell, replica.optimizer)

    def to_train(self) -> None:
        """The cell switches to training, its engine has let go of the GPUs (every rank of
        the cell waits for the leader's release): the trainer's state comes back."""
        arrive(self.comms.cell)
        if self.residency is not None:
            self.residency.restore(self.replica.cell, self.replica.optimizer)

    def to_rollout(self) -> None:
        """The cell switches to rollout: the trainer's state leaves the GPU before the
        engine takes it back (the leader resumes its engine once every rank is done)."""
        if self.residency is not None:
            self.residency.release(self.replica.cell, self.replica.optimizer)
        arrive(self.comms.cell)

    @property
    def core(self) -> bool:
        return self.comms.cell_id == 0

    def _sync(self, version: int) -> None:
        """Hold the batch's weights: a satellite behind `version` pulls the core's snapshot."""
        if self.version == version:
            return
        if self.core or self.transport is None:
            raise TrainingError(
                f"cell {self.comms.cell_id}: holds v{self.version}, the batch needs v{version}"
            )
        self.transport.pull(self.replica.cell.flat_params)
        self.replica.refresh()
        self.version = version

    def idle(self) -> None:
        """Between messages: a core rank serves the snapshot pulls waiting on it."""
        if self.core and self.transport is not None:
            self.transport.progress()

    @property
    def splits_rows(self) -> bool:
        return self.replica.dims.splits_rows

    def _mine(self, step: MicroStep) -> MicroStep:
        return share(step, self.comms.shard, self.ranks) if self.splits_rows else step

    def _leader(self) -> bool:
        return self.comms.shard == 0

    def prepass(self, m: msg.Prepass) -> dict[str, float] | None:
        """This rank's rows' ratio sums; on the leader the cell's (gathered if rows split)."""
        self._sync(m.version)
        mine = self._mine(m.step)
        sums = self.replica.cell.prepass(mine) if mine.rows else {}
        if not self.splits_rows:
            return sums if self._leader() else None
        parts = self.comms.cell.gather(sums, root=0)
        if parts is None:
            return None
        total: dict[str, float] = {}
        for part in parts:
            for eid, value in part.items():
                total[eid] = total.get(eid, 0.0) + value
        return total

    def accumulate(self, m: msg.Accumulate) -> StepStats | None:
        """Forward + backward of this rank's rows; on the leader the cell's stats, gathered."""
        self._sync(m.version)
        mine = self._mine(m.step)
        stats = (self.replica.cell.accumulate(mine, m.scalars) if mine.rows
                 else StepStats(targets=0, objective=0.0))  # fmt: skip
        if not self.splits_rows:
            return stats if self._leader() else None
        parts = self.comms.cell.gather((stats.targets, stats.objective), root=0)
        if parts is None:
            return None
        return StepStats(targets=sum(p[0] for p in parts), objective=sum(p[1] for p in parts))

    def reduce(self, m: msg.Reduce) -> float | None:
        """Sum gradients over prefix[m] and the core cell, 1/E, clip, AdamW, broadcast.

        Returns the pre-clip gradient norm on the core's leader, None elsewhere.
        """
        comms, replica = self.comms, self.replica
        cell = replica.cell
        total = reduce_to_core(comms, cell.flat_grads, participants=m.cells)  # my position
        norm = None
        if self.core:
            if self.splits_rows:
                total = sum_in_cell(comms, total)
            if replica.optimizer is not None:  # the core's leader, or every model-parallel rank
                norm = self._step(total, m)
            if self.splits_rows:
                broadcast_in_cell(comms, cell.flat_params)
            if self.transport is not None:
                self.transport.expose(cell.flat_params)
        broadcast_from_core(comms, cell.flat_params, participants=m.cells)
        cell.zero_grad()
        replica.refresh()
        self.version += 1
        return norm if self._leader() else None

    def _step(self, total: torch.Tensor, m: msg.Reduce) -> float:
        replica, cell = self.replica, self.replica.cell
        assert replica.optimizer is not None
        if m.num_executions == 0:
            return 0.0  # nothing to train (every group set aside): no optimizer step
        record = self.cfg.train.record_batches  # in the HF model's flat order, on the leader
        before = replica.hf_flat(cell.flat_params.detach().clone()) if record else None
        grad_sum = replica.hf_flat(total.clone()) if record else None
        opt_before = copy.deepcopy(replica.optimizer_state()) if record else None
        norm = replica.optimizer.step(batch_gradient(total, m.num_executions))
        after = replica.hf_flat(cell.flat_params.detach().clone()) if record else None
        if before is not None:
            audit.record_update(self.run_dir, m.batch, {
                "version": self.version, "params_before": before, "grad_sum": grad_sum,
                "optimizer_before": opt_before, "backend": self.cfg.train.backend,
                "grad_norm": norm, "params_after": after,
                "objective": dataclasses.asdict(cell.objective)})  # fmt: skip
        return norm

    def save_checkpoint(self, m: msg.SaveCheckpoint) -> int:
        """This rank's part of the core's checkpoint (every core rank takes part); bytes."""
        size = self.replica.save(Path(m.folder), self.version, self.comms.shard)
        arrive(self.comms.cell)  # the leader reports once every shard is on disk
        return size


class CellFollower:
    """A cell rank other than the leader: takes its part of every training pass, no engine.

    The coordinator sends the cell's training messages (Prepass, Accumulate, Reduce), its
    role switches (ToTrain, ToRollout: a trainer sharing its GPU with the engine moves its
    state), the core's SaveCheckpoint and Stop to every rank of the cell; only the leader
    answers.
    """

    def __init__(self, trainer: CellTrainer) -> None:
        self.trainer = trainer

    def serve(self, link: wire.Link) -> int:
        t = self.trainer
        handlers: dict[type, Callable[[Any], object]] = {
            msg.Prepass: t.prepass, msg.Accumulate: t.accumulate, msg.Reduce: t.reduce,
            msg.SaveCheckpoint: t.save_checkpoint,
            msg.ToTrain: lambda _: t.to_train(), msg.ToRollout: lambda _: t.to_rollout(),
        }  # fmt: skip
        while True:
            m = link.recv(timeout=IDLE_S if t.core else 3600.0)
            t.idle()
            if m is None:
                continue
            if isinstance(m, msg.Stop):
                return m.status
            handler = handlers.get(type(m))
            if handler is None:
                raise TrainingError(
                    f"cell {t.comms.cell_id} rank {t.comms.shard}: got {type(m).__name__}; "
                    "a follower only takes Prepass, Accumulate, Reduce, SaveCheckpoint, "
                    "ToTrain, ToRollout and Stop"
                )
            handler(m)


class CellProcess:
    """The loop of one cell (or standalone engine) rank."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine_index: int,
        comms: Communicators | None,
        run_dir: Path,
        engine: EngineHost,
        replica: Replica | None = None,
        transport: Any = None,
        version: int = 0,
        residency: TrainerResidency | None = None,
    ) -> None:
        self.cfg, self.index, self.comms, self.run_dir = cfg, engine_index, comms, run_dir
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
            msg.ToTrain: self.to_train,
            msg.ToRollout: self.to_rollout,
            msg.Prepass: self.prepass,
            msg.Accumulate: self.accumulate,
            msg.Reduce: self.reduce,
            msg.Publish: self.publish,
            msg.SavePolicy: self.save_policy,
            msg.Respawn: self.respawn,
            msg.Reload: self.reload,
            msg.SaveCheckpoint: self.save_checkpoint,
        }

    @property
    def core(self) -> bool:
        return self.index == 0

    # ------------------------------------------------------------------ loop

    def serve(self, link: wire.Link) -> int:
        """Report the engine, then obey messages until `Stop`; returns the stop status."""
        self.link = link
        url = self._start_engine()
        if self.version > 0:  # resumed from a checkpoint: the engine serves its weights
            self.engine.load_weights(self._checkpoint_weights(), self.version)
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

        if self.trainer is not None:
            self.trainer.to_rollout()

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
        detail = {"engine_version": self.engine.version}  # the weights it serves from now on
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
        named = self._named()
        tp = self.cfg.engine.tensor_parallel
        if self.cfg.engine.distributed(sum(t.numel() * t.element_size() for _, t in named)):
            missed = push_weights_distributed(m.targets, named, m.version, tp_size=tp,
                                              host=self.engine.host)  # fmt: skip
        else:
            missed = []
            for engine, url in m.targets:
                try:
                    push_weights(url, named, m.version, tp_size=tp)
                except EngineError:  # refused / reset / timed out: the engine died or is dying
                    missed.append(engine)
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
