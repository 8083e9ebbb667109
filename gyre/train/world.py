"""Streaming batches across an MPI world: the coordinator's queue service and the cell loop.

World layout: the coordinator (holding the stream packing buffer and the micro-step queue) and
K cells; cell 0 is the core (authoritative weights, sole optimizer), cells 1..K-1 satellites.
Each batch runs in two phases over the same micro-steps (docs/objective.md):

* phase A — cells claim micro-steps and return per-execution log-ratio sums (no-grad
  forward). When the stream is closed and every sum is in, the coordinator computes each
  execution's sequence ratio and clipping gate.
* phase B — cells claim the micro-steps again, with the scalars of their executions and the
  batch's E, and accumulate gradients.

Satellites join (`Coordinator.join`, in cell order, only while the batch runs — the join
window), pull the core's snapshot and claim work like any cell. When every phase-B result is
in, the participating cells (a prefix 0..m-1) sum gradients to the core over `prefix[m]`; the
core clips, steps Adam and broadcasts parameters back; at the end of a burst of μ steps it
calls the publication hook and satellites leave training.

Messages are pickled (`send`/`recv`): cells send `("claim", result)` on TAG_CLAIM and the
core `("updated", info)` on TAG_UPDATED; the coordinator answers claims on TAG_CMD with
`("A", step)`, `("B", step, scalars, E)`, `("reduce", m, end_of_burst)` or `("stop",)`, and
wakes idle satellites with `("join",)` or `("stop",)`. A claim stays unanswered until there is
work, so idle cells block in `recv` instead of polling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gyre.errors import TrainingError
from gyre.train.cell import CoreOptimizer, TorchCell
from gyre.train.comm import Communicators, broadcast_from_core, reduce_to_core
from gyre.train.objective import ExecutionScalar, ObjectiveConfig, execution_scalars, merge_sums
from gyre.train.packing import MicroStep
from gyre.train.stream import BatchInfo, Claim, MicroStepQueue
from gyre.train.transfer import SnapshotTransport

TAG_CLAIM, TAG_UPDATED, TAG_CMD = 11, 12, 13


class StepSource(Protocol):
    """What the coordinator pulls micro-steps from (a `StreamPackingBuffer` fits)."""

    closed: bool

    def pull(self) -> list[MicroStep]: ...
    def batch_info(self) -> BatchInfo: ...


@dataclass(slots=True)
class BatchReport:
    """What the coordinator learns about one finished batch."""

    participants: int
    prepass_by_cell: dict[int, list[int]]  # phase-A micro-step indices per cell
    steps_by_cell: dict[int, list[int]]  # phase-B micro-step indices per cell
    update: dict[str, Any] = field(default_factory=dict)  # the core's "updated" info


class Coordinator:
    """World rank holding the micro-step queue; answers claims, runs joins, ends batches."""

    def __init__(self, comms: Communicators, *, cell_ranks: list[int], objective: ObjectiveConfig):
        self.comms = comms
        self.cell_ranks = cell_ranks  # world rank of each cell (single-rank cells)
        self.objective = objective
        self.active = [False] * len(cell_ranks)  # in training (claiming) right now
        self.waiting: list[int] = []  # cells whose claim is unanswered
        self.batches = 0

    def _send(self, cell: int, msg: tuple) -> None:
        self.comms.world.send(msg, dest=self.cell_ranks[cell], tag=TAG_CMD)

    def join(self, cell: int) -> bool:
        """Let a satellite join the running batch (in cell order); False if it may not yet."""
        if self.active[cell] or (cell > 0 and not self.active[cell - 1]):
            return False
        self.active[cell] = True
        self._send(cell, ("join",))
        return True

    def participants(self) -> int:
        """m: cells 0..m-1 are training."""
        return self.active.index(False) if False in self.active else len(self.active)

    def _recv(self) -> tuple[int, tuple]:
        from mpi4py import MPI

        status = MPI.Status()
        msg = self.comms.world.recv(source=MPI.ANY_SOURCE, tag=TAG_CLAIM, status=status)
        return self.cell_ranks.index(status.Get_source()), msg

    def run_batch(
        self,
        source: StepSource,
        *,
        end_of_burst: bool,
        on_progress: Callable[[Coordinator, int], None] | None = None,
    ) -> BatchReport:
        """Stream one batch through phases A and B, then reduce and update; see module doc."""
        if not self.active[0]:
            self.join(0)
        run = _BatchRun(self, source)
        while not run.finished():
            if on_progress is not None:
                on_progress(self, run.handed_out)
            run.feed()
            served = run.serve_waiting()
            if run.finished():
                break
            if not served and len(self.waiting) == sum(self.active):
                raise TrainingError(
                    "stream starved: every training cell waits, the stream is open and no "
                    "ready group is available; feed groups before or during run_batch"
                )
            cell, msg = self._recv()
            run.record(cell, msg[1])
            self.waiting.append(cell)
        return self._finish(run, end_of_burst)

    def _finish(self, run: _BatchRun, end_of_burst: bool) -> BatchReport:
        m = self.participants()
        while len(self.waiting) < m:  # a satellite that joined late has not claimed yet
            cell, msg = self._recv()
            run.record(cell, msg[1])
            self.waiting.append(cell)
        for cell in list(self.waiting):
            self._send(cell, ("reduce", m, end_of_burst))
        self.waiting.clear()
        info = self.comms.world.recv(source=self.cell_ranks[0], tag=TAG_UPDATED)
        if end_of_burst:
            self.active = [True] + [False] * (len(self.active) - 1)
        self.batches += 1
        return BatchReport(
            participants=m,
            prepass_by_cell=run.prepass_by_cell,
            steps_by_cell=run.steps_by_cell,
            update=info,
        )

    def stop(self) -> None:
        """End every cell's loop (idle satellites and claiming cells alike)."""
        for _ in range(sum(self.active) - len(self.waiting)):
            self._recv()  # drain the claims sent after the last batch
        self.waiting.clear()
        for cell in range(len(self.cell_ranks)):
            self._send(cell, ("stop",))


class _BatchRun:
    """Book-keeping of one batch on the coordinator."""

    def __init__(self, coord: Coordinator, source: StepSource) -> None:
        self.coord, self.source = coord, source
        self.queue_a, self.queue_b = MicroStepQueue(), MicroStepQueue()
        self.steps: list[MicroStep] = []
        self.sums: dict[int, dict[str, float]] = {}
        self.done_b: set[int] = set()
        self.scalars: dict[str, ExecutionScalar] | None = None
        self.info: BatchInfo | None = None
        self.prepass_by_cell: dict[int, list[int]] = {}
        self.steps_by_cell: dict[int, list[int]] = {}
        self.handed_out = 0

    def feed(self) -> None:
        if not self.source.closed and not self.queue_a.queued:
            new = self.source.pull()
            self.steps += new
            self.queue_a.put(new)
        if self.source.closed and not self.queue_a.closed:
            if not self.steps:
                raise TrainingError("empty batch: the stream closed without micro-steps")
            self.queue_a.close()

    def _next(self, cell: int) -> tuple | None:
        if self.scalars is None:
            got = self.queue_a.claim()
            if isinstance(got, MicroStep):
                self.prepass_by_cell.setdefault(cell, []).append(got.index)
                return ("A", got)
            if got is Claim.WAIT or len(self.sums) < len(self.steps):
                return None
            self._enter_phase_b()
        got = self.queue_b.claim()
        if not isinstance(got, MicroStep):
            return None
        assert self.scalars is not None and self.info is not None
        self.steps_by_cell.setdefault(cell, []).append(got.index)
        mine = {r.execution_id: self.scalars[r.execution_id] for r in got.rows}
        return ("B", got, mine, self.info.num_executions)

    def _enter_phase_b(self) -> None:
        self.info = self.source.batch_info()
        sums = merge_sums([self.sums[s.index] for s in self.steps])
        self.scalars = execution_scalars(sums, self.info.executions, self.coord.objective)
        self.queue_b.put(self.steps)
        self.queue_b.close()

    def serve_waiting(self) -> bool:
        served = False
        for cell in list(self.coord.waiting):
            work = self._next(cell)
            if work is None:
                continue
            self.coord.waiting.remove(cell)
            self.handed_out += 1
            self.coord._send(cell, work)
            served = True
        return served

    def record(self, cell: int, result: tuple | None) -> None:
        if result is None:
            return
        phase, index, payload = result
        if phase == "A":
            self.sums[index] = payload
        else:
            self.done_b.add(index)

    def finished(self) -> bool:
        return self.scalars is not None and len(self.done_b) == len(self.steps)


class CellWorker:
    """The loop one cell rank runs: wait to join, claim, compute, reduce, update, publish."""

    def __init__(
        self,
        comms: Communicators,
        cell: TorchCell,
        transport: SnapshotTransport,
        *,
        coordinator_rank: int,
        optimizer: CoreOptimizer | None = None,
        publish: Callable[[torch.Tensor, int], None] | None = None,
        on_update: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        self.comms, self.cell, self.transport = comms, cell, transport
        self.coordinator_rank = coordinator_rank
        self.is_core = comms.cell_id == 0
        if self.is_core and optimizer is None:
            raise TrainingError("the core cell needs the optimizer")
        self.optimizer, self.publish, self.on_update = optimizer, publish, on_update
        self.version = 0
        self.pull_seconds: list[float] = []

    def _cmd(self) -> tuple:
        return self.comms.world.recv(source=self.coordinator_rank, tag=TAG_CMD)

    def serve(self) -> None:
        """Run until the coordinator says stop."""
        fresh = self.is_core
        while True:
            cmd = self._cmd()
            if cmd[0] == "stop":
                return
            if cmd[0] != "join":
                raise TrainingError(f"cell {self.comms.cell_id}: unexpected command {cmd[0]!r}")
            if not fresh:
                self.pull_seconds.append(self.transport.pull(self.cell.flat_params))
            if self._train_until_burst_end():
                return
            fresh = self.is_core

    def _train_until_burst_end(self) -> bool:
        """Claim loop; returns True on stop, False when the burst ended for this cell."""
        result: tuple | None = None
        while True:
            self.comms.world.send(("claim", result), dest=self.coordinator_rank, tag=TAG_CLAIM)
            cmd = self._cmd()
            if cmd[0] == "stop":
                return True
            if cmd[0] == "A":
                result = ("A", cmd[1].index, self.cell.prepass(cmd[1]))
            elif cmd[0] == "B":
                self.cell.accumulate(cmd[1], cmd[2], cmd[3])
                result = ("B", cmd[1].index, None)
            elif cmd[0] == "reduce":
                self._reduce_and_update(cmd[1], cmd[2])
                result = None
                if cmd[2] and not self.is_core:
                    return False
            else:
                raise TrainingError(f"cell {self.comms.cell_id}: unexpected command {cmd[0]!r}")

    def _reduce_and_update(self, participants: int, end_of_burst: bool) -> None:
        total = reduce_to_core(self.comms, self.cell.flat_grads, participants=participants)
        info: dict[str, Any] = {}
        if self.is_core:
            assert self.optimizer is not None
            info["grad_norm"] = self.optimizer.step(total)
            self.version += 1
        broadcast_from_core(self.comms, self.cell.flat_params, participants=participants)
        self.cell.zero_grad()
        if self.is_core:
            self.transport.expose(self.cell.flat_params)
            if self.on_update is not None:
                self.on_update(self.version, total, self.cell.flat_params)
            if end_of_burst and self.publish is not None:
                self.publish(self.cell.flat_params, self.version)
            info.update(version=self.version, published=end_of_burst)
            self.comms.world.send(info, dest=self.coordinator_rank, tag=TAG_UPDATED)
