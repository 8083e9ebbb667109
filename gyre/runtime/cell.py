"""A cell rank: serves rollout through its engine, or trains its replica, as told.

The cell keeps two states in one long-lived process: the embedded engine (a child process,
`EngineProcess`) and the training replica (`gyre.train.cell.TorchCell`; on the core also the
optimizer). A switch to TRAIN aborts the engine's outstanding calls and releases its memory;
a switch to ROLLOUT resumes the engine. A satellite's replica pulls the core's weights
lazily, at its first pass of a batch whose weight version it does not hold: the core's
weights are fixed while any pass is outstanding, so a pull never sees an update half done.
Each switch reports its measured duration. Processes and communicators live across
switches; only model state moves.

The cell answers the coordinator's messages (`gyre.runtime.messages`, one handler per type):
ToTrain, ToRollout, Prepass, Accumulate, Reduce, Publish, SavePolicy, Respawn, Reload,
SaveCheckpoint, Stop. A standalone engine rank runs the same loop without a replica.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gyre.errors import EngineError, TrainingError
from gyre.rollout.kvmigrate import execution_prefix, migrate_kv
from gyre.runtime import audit, checkpoint, policies, wire
from gyre.runtime import messages as msg
from gyre.runtime.config import RunConfig
from gyre.runtime.engine_host import EngineProcess, push_weights
from gyre.runtime.layout import COORDINATOR_RANK
from gyre.train.cell import CoreOptimizer, TorchCell
from gyre.train.comm import Communicators, broadcast_from_core, reduce_to_core
from gyre.train.objective import batch_gradient


@dataclass(slots=True)
class Replica:
    """A cell's training state: the model replica, its tokenizer, the core's optimizer."""

    cell: TorchCell
    tokenizer: Any
    optimizer: CoreOptimizer | None = None


def build_replica(cfg: RunConfig, core: bool) -> Replica:
    """The cell's training replica (and, on the core, the optimizer)."""
    from gyre.models import load_model

    model, tokenizer = load_model(cfg.model)
    module: torch.nn.Module = model
    module.to(torch.device(cfg.train.device)).train()
    cell = TorchCell(model, objective=cfg.train.objective)
    return Replica(cell, tokenizer, CoreOptimizer(cell, cfg.train.optim) if core else None)


class CellProcess:
    """The loop of one cell (or standalone engine) rank."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine_index: int,
        comms: Communicators | None,
        run_dir: Path,
        engine: EngineProcess,
        replica: Replica | None = None,
        transport: Any = None,
        version: int = 0,
    ) -> None:
        self.cfg, self.index, self.comms, self.run_dir = cfg, engine_index, comms, run_dir
        self.engine, self.replica, self.transport = engine, replica, transport
        self.link: wire.Link | None = None
        self.version = version  # version of the replica's weights (> 0 after a resume)
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
            m = link.recv(timeout=0.05)  # a blocked wait; wakes to watch the engine
            if m is None:
                continue
            if isinstance(m, msg.Stop):
                self.engine.stop()
                return m.status
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

    def _replica(self) -> Replica:
        if self.replica is None:
            raise TrainingError(f"engine {self.index}: a standalone engine cannot train")
        return self.replica

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
        self._up(msg.Switched(self.index, "train", time.perf_counter() - t0, detail))

    def to_rollout(self, m: msg.ToRollout) -> None:
        t0 = time.perf_counter()

        def restore() -> None:
            self.engine.resume()
            if self.engine.version >= m.published:
                return
            if self.core:  # the core after a publication: its replica holds those weights
                self.engine.load_weights(self._named(), self.version)
            else:  # a satellite back after a publication it was released for (colocate)
                self._load_latest()

        self._engine_call(restore)
        detail = {"engine_version": self.engine.version}  # the weights it serves from now on
        self._up(msg.Switched(self.index, "rollout", time.perf_counter() - t0, detail))

    def _engine_call(self, call: Callable[[], None]) -> None:
        """Run a switch's engine step unless the engine is dead or dies during it.

        A lost engine is reported by the watch and restarted in the role the cell then
        has, so the switch itself goes on without it.
        """
        if self.engine.dead() is not None:
            return
        try:
            call()
        except OSError:
            if self.engine.dead() is None:
                time.sleep(0.5)  # a killed process may not be reaped yet
            if self.engine.dead() is None:
                raise

    # ------------------------------------------------------------------ training

    def _sync(self, version: int) -> None:
        """Hold the batch's weights: a satellite behind `version` pulls the core's snapshot."""
        if self.version == version:
            return
        if self.core or self.transport is None:
            raise TrainingError(
                f"cell {self.index}: holds v{self.version}, the batch needs v{version}"
            )
        self.transport.pull(self._replica().cell.flat_params)
        self.version = version

    def prepass(self, m: msg.Prepass) -> None:
        t0 = time.perf_counter()
        self._sync(m.version)
        sums = self._replica().cell.prepass(m.step)
        self._up(msg.Prepassed(self.index, m.batch, m.step.index, sums, time.perf_counter() - t0))

    def accumulate(self, m: msg.Accumulate) -> None:
        t0 = time.perf_counter()
        self._sync(m.version)
        stats = self._replica().cell.accumulate(m.step, m.scalars)
        self._up(msg.Accumulated(self.index, m.batch, m.step.index, stats.objective,
                                 stats.targets, time.perf_counter() - t0))  # fmt: skip

    def reduce(self, m: msg.Reduce) -> None:
        """Sum gradients over prefix[m] at the core, 1/E, clip, AdamW, broadcast."""
        assert self.comms is not None
        t0 = time.perf_counter()
        replica = self._replica()
        cell = replica.cell
        total = reduce_to_core(self.comms, cell.flat_grads, participants=m.cells)
        norm = None
        if replica.optimizer is not None:
            before = cell.flat_params.detach().clone() if self.cfg.train.record_batches else None
            opt_before = (
                copy.deepcopy(replica.optimizer.opt.state_dict()) if before is not None else None
            )
            norm = replica.optimizer.step(batch_gradient(total, m.num_executions))
            if self.transport is not None:
                self.transport.expose(cell.flat_params)
            if before is not None:
                audit.record_update(self.run_dir, m.batch, {
                    "version": self.version, "params_before": before, "grad_sum": total.clone(),
                    "optimizer_before": opt_before,
                    "grad_norm": norm, "params_after": cell.flat_params.detach().clone(),
                    "objective": dataclasses.asdict(cell.objective)})  # fmt: skip
        broadcast_from_core(self.comms, cell.flat_params, participants=m.cells)
        cell.zero_grad()
        self.version += 1
        self._up(msg.Updated(self.index, m.batch, norm, time.perf_counter() - t0))

    def publish(self, m: msg.Publish) -> None:
        """Core: keep the policy, then push it to every rollout engine.

        The policy directory is written first, so an engine that dies around the
        publication (its push fails, or it restarts before it) loads this version when it
        comes back. Engines whose push failed are reported, never fatal: the coordinator has
        them reload.
        """
        t0 = time.perf_counter()
        self._save(policies.version_name(m.version), keep=self.cfg.train.keep_policies)
        named = self._named()
        missed = []
        for engine, url in m.targets:
            try:
                push_weights(url, named, m.version)
            except OSError:  # refused / reset / timed out: the engine died or is dying
                missed.append(engine)
        self._up(msg.Published(m.version, time.perf_counter() - t0, missed))

    def save_policy(self, m: msg.SavePolicy) -> None:
        path = self._save(m.name, keep=None)
        self._up(msg.PolicySaved(self.version, str(path)))

    def _save(self, name: str, keep: int | None) -> Path:
        replica = self._replica()
        return policies.save_policy(self.run_dir, name, replica.cell.model, replica.tokenizer,
                                    version=self.version, keep=keep)  # fmt: skip

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self._replica().cell.model.named_parameters()]

    # ------------------------------------------------------------------ engine loss

    def respawn(self, m: msg.Respawn) -> None:
        """Restart a lost engine with the latest policy; released again if the cell trains."""
        self.engine.stop()
        self.engine.spawn()
        url = self._start_engine()
        self._load_latest()
        if m.role != "rollout":
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
        if self.replica is not None:
            return self._named()
        data = checkpoint.load_core(self.run_dir)
        assert data is not None, "a resumed standalone engine needs a checkpoint"
        return list(data["named"])

    def save_checkpoint(self, m: msg.SaveCheckpoint) -> None:
        """Core: weights + optimizer state into the checkpoint directory being written."""
        t0 = time.perf_counter()
        size = checkpoint.save_core(Path(m.folder), self._named(), self._replica().optimizer,
                                    self.version)  # fmt: skip
        self._up(msg.Checkpointed(self.version, m.folder, size, time.perf_counter() - t0))
