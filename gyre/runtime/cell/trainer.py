"""One cell rank's training work: the one implementation every rank of a cell runs.

`CellTrainer` holds the rank's part of the cell's replica (built by the training backend,
`gyre.train.backends`) and does its share of each pass and update the coordinator sends
(Prepass, Accumulate, Reduce), its role switches' residency moves and its part of the core's
checkpoint. The leader's loop (`gyre.runtime.cell.leader.CellProcess`) and the other ranks'
(`gyre.runtime.cell.follower`) both drive it.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch

from gyre.errors import TrainingError
from gyre.runtime.cell.residency import TrainerResidency
from gyre.runtime.shared import audit
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import RunConfig
from gyre.train.backends import Replica
from gyre.train.cell import StepStats
from gyre.train.comm import (
    Communicators,
    arrive,
    broadcast_from_core,
    broadcast_over_replicas,
    reduce_to_core,
    sum_over_replicas,
)
from gyre.train.objective import batch_gradient
from gyre.train.packing import MicroStep


def share(step: MicroStep, replica: int, replicas: int) -> MicroStep:
    """Replica `replica`'s rows of a micro-step split over a cell's `replicas` data-parallel
    replicas (every rank of a torch cell; a Megatron cell's replicas of the model).

    Rows are ordered longest first, so striding gives every replica a similar load; a
    replica left without rows (a step with fewer rows than replicas) does no pass for it.
    """
    return dataclasses.replace(step, rows=step.rows[replica::replicas])


class CellTrainer:
    """One rank's part of its cell's training replica (`gyre.train.backends.Replica`).

    Data parallel inside the cell (`dims.splits_rows`): each pass's rows are split over the
    cell's replicas of the model (`comms.replicas`: every rank of a torch cell, which holds
    the whole model; the TP x PP ranks of one Megatron replica each run its rows on their
    shard), whose results the leader (shard 0) gathers and reports. An update sums each
    cell's replicas' gradients onto its replica 0, sums those over the prefix communicator
    (per shard position) onto the core, steps the optimizer on the core's replica 0 (its
    leader for torch, each of its model-parallel ranks for Megatron) and sends the weights
    back the same way: over the prefix communicator, then to every replica of each cell.
    With one rank per cell every collective inside the cell is a no-op and this is the
    single-rank cell.
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
        if residency is not None and not residency.released:  # cells start in rollout: the
            residency.release(replica.cell, replica.optimizer)  # role parked it, else here

    def to_train(self) -> None:
        """The cell switches to training, its engine has let go of the GPUs (every rank of
        the cell waits for the leader's release): the trainer's state comes back."""
        arrive(self.comms.cell)
        if self.residency is not None:
            self.residency.restore(self.replica.cell, self.replica.optimizer)

    def to_rollout(self) -> dict[str, int]:
        """The cell switches to rollout: the trainer's state leaves the GPU before the
        engine takes it back (the leader resumes its engine once every rank is done).
        Returns this rank's park (`TrainerResidency.release`: bytes parked, device memory
        allocated before and after), empty when the trainer does not share its GPU."""
        parked: dict[str, int] = {}
        if self.residency is not None:
            parked = self.residency.release(self.replica.cell, self.replica.optimizer)
        arrive(self.comms.cell)
        return parked

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
        self.version = version

    def idle(self) -> None:
        """Between messages: a core rank serves the snapshot pulls waiting on it."""
        if self.core and self.transport is not None:
            self.transport.progress()

    def _mine(self, step: MicroStep) -> MicroStep:
        replicas = self.comms.replicas.Get_size()
        return share(step, self.comms.data_rank, replicas) if replicas > 1 else step

    def _leader(self) -> bool:
        return self.comms.shard == 0

    def prepass(self, m: msg.Prepass) -> list[dict[str, float]] | None:
        """This replica's rows' ratio sums of each micro-step of the window; on the leader
        the cell's (gathered over its replicas)."""
        self._sync(m.version)
        mine = self._window(m.steps)
        done = iter(self.replica.cell.prepass_window([s for s in mine if s.rows]))
        sums = [next(done) if step.rows else {} for step in mine]
        parts = self.comms.replicas.gather(sums, root=0)
        if not self._leader():
            return None
        totals: list[dict[str, float]] = []
        for each in zip(*parts, strict=True):  # one micro-step's sums from every replica
            total: dict[str, float] = {}
            for part in each:
                for eid, value in part.items():
                    total[eid] = total.get(eid, 0.0) + value
            totals.append(total)
        return totals

    def accumulate(self, m: msg.Accumulate) -> StepStats | None:
        """Forward + backward of this replica's rows of the window; on the leader the
        cell's stats, summed over the window and gathered over its replicas."""
        self._sync(m.version)
        mine = [s for s in self._window(m.steps) if s.rows]
        stats = self.replica.cell.accumulate_window(mine, m.scalars)
        local = (sum(s.targets for s in stats), sum(s.objective for s in stats))
        parts = self.comms.replicas.gather(local, root=0)
        if not self._leader():
            return None
        return StepStats(targets=sum(p[0] for p in parts), objective=sum(p[1] for p in parts))

    def _window(self, steps: tuple[MicroStep, ...]) -> list[MicroStep]:
        """This replica's rows of each micro-step of a window (a step may leave it none)."""
        return [self._mine(step) for step in steps]

    def reduce(self, m: msg.Reduce) -> float | None:
        """Sum gradients over the cell's replicas, then prefix[m] into the core, 1/E, clip,
        AdamW, broadcast back over prefix[m] and the replicas.

        Returns the pre-clip gradient norm on the core's leader, None elsewhere.
        """
        comms, replica = self.comms, self.replica
        cell = replica.cell
        first = comms.data_rank == 0  # the replica that talks to the other cells
        total = sum_over_replicas(comms, cell.flat_grads)
        norm = None
        if first:
            total = reduce_to_core(comms, total, participants=m.cells)  # my position
            if self.core and replica.optimizer is not None:  # the core's replica 0
                norm = self._step(total, m)
            broadcast_from_core(comms, cell.flat_params, participants=m.cells)
        broadcast_over_replicas(comms, cell.flat_params)
        if self.core and self.transport is not None:
            self.transport.expose(cell.flat_params)
        cell.zero_grad()
        self.version += 1
        return norm if self._leader() else None

    def _step(self, total: torch.Tensor, m: msg.Reduce) -> float:
        replica, cell = self.replica, self.replica.cell
        assert replica.optimizer is not None
        if m.num_executions == 0:
            return 0.0  # nothing to train (every group set aside): no optimizer step
        # in the HF model's flat order, on the leader; the weights AdamW steps (float32 main
        # weights where the cell is mixed precision)
        record, main = self.cfg.train.record_batches, replica.optimizer.main
        before = replica.hf_flat(main.detach().clone()) if record else None
        grad_sum = replica.hf_flat(total.clone()) if record else None
        opt_before = copy.deepcopy(replica.optimizer_state()) if record else None
        lr = self.cfg.train.lr_at(self.version, self.cfg.steps)  # update `version` of the run
        norm = replica.optimizer.step(batch_gradient(total, m.num_executions), lr=lr)
        after = replica.hf_flat(main.detach().clone()) if record else None
        if before is not None:
            audit.record_update(self.run_dir, m.batch, {
                "version": self.version, "params_before": before, "grad_sum": grad_sum,
                "optimizer_before": opt_before, "backend": self.cfg.train.backend,
                "grad_norm": norm, "lr": lr, "params_after": after,
                "objective": dataclasses.asdict(cell.objective)})  # fmt: skip
        return norm

    def save_checkpoint(self, m: msg.SaveCheckpoint) -> int:
        """This rank's part of the core's checkpoint (every core rank takes part); bytes."""
        size = self.replica.save(Path(m.folder), self.version, self.comms.shard)
        arrive(self.comms.cell)  # the leader reports once every shard is on disk
        return size
