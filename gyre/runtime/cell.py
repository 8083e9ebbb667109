"""A cell rank: serves rollout through its engine, or trains its replica, as told.

The cell keeps two states in one long-lived process: the embedded engine (a child process,
`EngineProcess`) and the training replica (`gyre.train.cell.TorchCell`; on the core also the
optimizer). A switch to TRAIN aborts the engine's outstanding calls and releases its memory;
a satellite then pulls the core's weights. A switch to ROLLOUT resumes the engine and loads
the replica's weights into it if they are newer. Each switch reports its measured duration.
Processes and communicators live across switches; only model state moves.

Commands from the coordinator (tag DOWN): to_train, to_rollout, prepass, train, publish,
respawn, reload, stop. Reports (tag UP): engine_ready, switched, prepassed, updated, published,
engine_lost. A standalone engine rank runs the same loop without a replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gyre.errors import TrainingError
from gyre.runtime import checkpoint, wire
from gyre.runtime.config import RunConfig
from gyre.runtime.engine_host import EngineProcess, push_weights
from gyre.runtime.layout import COORDINATOR_RANK
from gyre.train.cell import CoreOptimizer, OptimConfig, TorchCell
from gyre.train.comm import Communicators, broadcast_from_core, reduce_to_core
from gyre.train.objective import ObjectiveConfig

PUBLISHED = "published.pt"


def build_replica(cfg: RunConfig, core: bool) -> tuple[TorchCell, CoreOptimizer | None]:
    """The cell's training replica (and, on the core, the optimizer)."""
    from gyre.models import load_model

    model, _ = load_model(cfg.model)
    model.train()
    replica = TorchCell(model, objective=ObjectiveConfig())
    if not core:
        return replica, None
    optim = OptimConfig(lr=cfg.train.lr, grad_clip=cfg.train.grad_clip)
    return replica, CoreOptimizer(replica, optim)


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
        replica: TorchCell | None = None,
        optimizer: CoreOptimizer | None = None,
        transport: Any = None,
        version: int = 0,
    ) -> None:
        self.cfg, self.index, self.comms, self.run_dir = cfg, engine_index, comms, run_dir
        self.engine, self.replica, self.optimizer = engine, replica, optimizer
        self.transport = transport
        self.world = comms.world if comms is not None else None
        self.version = version  # version of the replica's weights (> 0 after a resume)
        self.lost_reported = False

    # ------------------------------------------------------------------ loop

    def serve(self, world: Any) -> int:
        """Report the engine, then obey commands until `stop`; returns the stop status."""
        self.world = world
        url = self.engine.wait_ready(self.cfg.timeouts.startup_s)
        if self.version > 0:  # resumed from a checkpoint: the engine serves its weights
            named = self._checkpoint_weights()
            self.engine.load_weights(named, self.version)
            if self.index == 0:  # what a restarted engine loads
                torch.save({"version": self.version, "named": named}, self.run_dir / PUBLISHED)
        self._up(("engine_ready", self.index, url, self.engine.version))
        handlers: dict[str, Callable[..., None]] = {
            "to_train": self._to_train,
            "to_rollout": self._to_rollout,
            "prepass": self._prepass,
            "train": self._train,
            "publish": self._publish,
            "respawn": self._respawn,
            "reload": self._reload,
            "checkpoint": self._checkpoint,
        }
        while True:
            self._watch_engine()
            msg = wire.poll(world, COORDINATOR_RANK, wire.DOWN, timeout=0.05)
            if msg is None:
                continue
            if msg[0] == "stop":
                self.engine.stop()
                return int(msg[1])
            handlers[msg[0]](*msg[1:])

    def _up(self, msg: tuple) -> None:
        wire.send(self.world, msg, COORDINATOR_RANK, wire.UP)

    def _watch_engine(self) -> None:
        rc = self.engine.dead()
        if rc is not None and not self.lost_reported:
            self.lost_reported = True
            self._up(("engine_lost", self.index, rc))

    # ------------------------------------------------------------------ role switches

    def _to_train(self, version: int) -> None:
        t0 = time.perf_counter()
        self._engine_call(self.engine.release)
        if self.replica is None:
            raise TrainingError(f"engine {self.index}: a standalone engine cannot train")
        if self.index != 0 and self.transport is not None:
            self.transport.pull(self.replica.flat_params)  # the core's current weights
            self.version = version
        self.replica.zero_grad()
        self._up(("switched", self.index, "train", time.perf_counter() - t0))

    def _to_rollout(self, published: int) -> None:
        t0 = time.perf_counter()

        def restore() -> None:
            self.engine.resume()
            if self.replica is not None and self.engine.version < published:
                self.engine.load_weights(self._named(), self.version)

        self._engine_call(restore)
        self._up(("switched", self.index, "rollout", time.perf_counter() - t0))

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

    def _checkpoint_weights(self) -> list[tuple[str, torch.Tensor]]:
        if self.replica is not None:
            return self._named()
        return list(torch.load(self.run_dir / checkpoint.WEIGHTS, weights_only=True)["named"])

    def _checkpoint(self) -> None:
        """Core: save weights + optimizer state for a resumed job."""
        checkpoint.save_core(self.run_dir, self._named(), self.optimizer, self.version)
        self._up(("checkpointed", self.version))

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        assert self.replica is not None
        return [(n, p.detach()) for n, p in self.replica.model.named_parameters()]

    # ------------------------------------------------------------------ training

    def _prepass(self, batch: int, step: Any) -> None:
        assert self.replica is not None
        sums = self.replica.prepass(step)
        self._up(("prepassed", self.index, batch, step.index, sums))

    def _train(self, batch: int, steps: list, scalars: dict, num_exec: int, m: int) -> None:
        """Phase B on this cell's share, reduce over prefix[m], core update, broadcast."""
        assert self.replica is not None and self.comms is not None
        t0 = time.perf_counter()
        objective, targets = 0.0, 0
        for step in steps:
            stats = self.replica.accumulate(step, scalars, num_exec)
            objective += stats.objective
            targets += stats.targets
        total = reduce_to_core(self.comms, self.replica.flat_grads, participants=m)
        info: dict[str, Any] = {}
        if self.index == 0:
            assert self.optimizer is not None
            info["grad_norm"] = self.optimizer.step(total)
        broadcast_from_core(self.comms, self.replica.flat_params, participants=m)
        self.replica.zero_grad()
        self.version += 1
        self._up(("updated", self.index, batch, objective, targets, time.perf_counter() - t0, info))

    def _publish(self, version: int, targets: list[tuple[int, str]]) -> None:
        """Core: push the weights to every rollout engine; keep a copy for restarts.

        The copy is written first, so an engine that dies around the publication (its push
        fails, or it restarts before it) loads this version when it comes back. Engines
        whose push failed are reported, never fatal: the coordinator has them reload.
        """
        t0 = time.perf_counter()
        named = self._named()
        torch.save({"version": version, "named": named}, self.run_dir / PUBLISHED)
        missed = []
        for engine, url in targets:
            try:
                push_weights(url, named, version)
            except OSError:  # refused / reset / timed out: the engine died or is dying
                missed.append(engine)
        self._up(("published", version, time.perf_counter() - t0, missed))

    # ------------------------------------------------------------------ engine loss

    def _respawn(self, role: str) -> None:
        """Restart a lost engine with the last published weights; released if training."""
        self.engine.stop()
        self.engine.spawn()
        url = self.engine.wait_ready(self.cfg.timeouts.startup_s)
        saved = self.run_dir / PUBLISHED
        if saved.exists():
            data = torch.load(saved, weights_only=True)
            self.engine.load_weights(data["named"], int(data["version"]))
        if role != "rollout":
            self.engine.release()
        self.lost_reported = False
        self._up(("engine_ready", self.index, url, self.engine.version))

    def _reload(self) -> None:
        """Load the last published weights if this engine missed them (a failed push).

        A dead engine is left alone (its restart loads them); a released one is too (its
        return to rollout loads the replica's weights).
        """
        saved = self.run_dir / PUBLISHED
        if self.engine.dead() is not None or self.engine.released or not saved.exists():
            return
        data = torch.load(saved, weights_only=True)
        if int(data["version"]) > self.engine.version:
            self._engine_call(lambda: self.engine.load_weights(data["named"], int(data["version"])))
