"""Communicators of the training plane, built once at start (DESIGN.md "Processes").

* `world` — every process (coordinator + all cell ranks), used for control messages;
* `cell`  — `Split` by cell id (the ranks of one cell, its leader first; the coordinator gets
  its own);
* `replicas` — the cell's data-parallel replicas of this rank's shard of the model (the
  whole cell where every rank holds the whole model; a model-parallel backend splits it by
  shard position, `split_replicas`): they split each pass's rows and sum their gradients;
* `cells` — every cell rank in world-rank order (cell by cell, shards in order): the world
  of a training backend's own process groups (Megatron's torch.distributed);
* `prefix[m]` for m = 2..K — ranks of cells 0..m-1 holding the same shard position, ordered by
  cell, so rank 0 of every prefix communicator is the core's rank at that position.

Gradients are summed over each cell's replicas first, then from every cell's first replica
to the core over the prefix communicator matching the cells taking part in the batch (core +
satellites joined in order); parameters go back the same way.
CUDA tensors are staged through host memory (the `mpich` wheel is not CUDA-aware).

    comms = build_communicators(MPI.COMM_WORLD, cell_of_rank=[None, 0, 1, 2])
    total = reduce_to_core(comms, cell.flat_grads, participants=2)   # on the core: the sum
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gyre.errors import TrainingError

if TYPE_CHECKING:  # torch only where tensors move: the coordinator and proxy never import it
    import torch

    from gyre.train.config import ParallelDims


def arrive(comm: Any, max_poll_s: float = 0.05) -> None:
    """Wait, without spinning a core, until every rank of `comm` arrives here.

    MPICH busy-polls inside blocking collectives: a rank that reaches a start-up `bcast` while
    the core cell still builds its replica would burn a whole core for that time, taking it
    from the ranks doing the work (on one machine, start-up took several times longer). So
    every collective that ranks reach at very different times is preceded by this barrier,
    which sleeps between tests of a nonblocking `Ibarrier`; the collective then finds every
    rank present and returns at once."""
    req = comm.Ibarrier()
    delay = 0.001
    while not req.Test():
        time.sleep(delay)
        delay = min(delay * 2, max_poll_s)


class Alone:
    """The communicator of one process (a publication or a policy with one sender: `publish`,
    `save_policy`): every collective returns at once."""

    def Get_rank(self) -> int:
        return 0

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        return [obj]

    def Ibarrier(self) -> Alone:
        return self

    def Test(self) -> bool:  # the request `Ibarrier` returns: complete at once
        return True


@dataclass(slots=True)
class Communicators:
    """This process's view of the world, its cell and the prefix sets it belongs to."""

    world: Any
    cell: Any
    cell_id: int | None  # None on the coordinator
    shard: int  # position within the cell
    num_cells: int
    prefix: dict[int, Any] = field(default_factory=dict)  # m -> communicator of cells 0..m-1
    cells: Any = None  # every cell rank, cell by cell (None off the cells): a backend's world
    replicas: Any = None  # this cell's data-parallel replicas of this rank's shard, replica
    # 0 first (build_communicators: the whole cell; `split_replicas` narrows it)

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel replica in its cell (0: the one that reduces across
        cells)."""
        return int(self.replicas.Get_rank())

    @classmethod
    def alone(cls, cell_id: int) -> Communicators:
        """A one-rank cell training by itself in this process (on MPI's COMM_SELF)."""
        from mpi4py import MPI

        return cls(world=MPI.COMM_SELF, cell=MPI.COMM_SELF, cell_id=cell_id, shard=0,
                   num_cells=1, replicas=MPI.COMM_SELF)  # fmt: skip


def build_communicators(world: Any, *, cell_of_rank: Sequence[int | None]) -> Communicators:
    """Collective over `world`: Split per cell and the K-1 prefix communicators (once)."""
    from mpi4py import MPI

    if len(cell_of_rank) != world.Get_size():
        raise TrainingError(
            f"cell_of_rank: {len(cell_of_rank)} entries for {world.Get_size()} ranks"
        )
    rank = world.Get_rank()
    cid = cell_of_rank[rank]
    cells = sorted({c for c in cell_of_rank if c is not None})
    if cells != list(range(len(cells))):
        raise TrainingError(f"cell_of_rank: cell ids must be 0..K-1, got {cells}")
    shard = [r for r, c in enumerate(cell_of_rank) if c == cid].index(rank)
    cell = world.Split(len(cells) if cid is None else cid, rank)
    comms = Communicators(world=world, cell=cell, cell_id=cid, shard=shard, num_cells=len(cells),
                          replicas=cell)  # fmt: skip
    every_cell = world.Split(MPI.UNDEFINED if cid is None else 0, rank)
    comms.cells = None if cid is None else every_cell
    for m in range(2, len(cells) + 1):
        member = cid is not None and cid < m
        color = shard if member else MPI.UNDEFINED
        comm = world.Split(color, cid if member else 0)
        if member:
            comms.prefix[m] = comm
    return comms


def split_replicas(comms: Communicators, dims: ParallelDims) -> None:
    """Collective over the cell, once: narrow `comms.replicas` to the cell's data-parallel
    replicas of this rank's shard of a model laid out by `dims` (the ranks of its shard
    position, `ParallelDims.place`), replica 0 first."""
    if dims.model_parallel == 1 or comms.cell.Get_size() == 1:
        return
    comms.replicas = comms.cell.Split(dims.place(comms.shard).position, comms.shard)


def _host(t: torch.Tensor, *, summed: bool = False) -> tuple[Any, torch.Tensor]:
    """(a numpy view of `t` on the host, that host tensor). numpy has no bfloat16: a bf16
    tensor is viewed as its raw 16-bit words, which a broadcast copies as they are but a sum
    would add as integers, so a 16-bit tensor is refused where it is `summed` (gradients
    add up in float32: `gyre.train.cell.main_dtype`)."""
    import torch

    h = t if t.device.type == "cpu" else t.detach().to("cpu")
    if h.dtype in (torch.bfloat16, torch.float16):
        if summed:
            raise TrainingError(f"a sum over MPI of a {h.dtype} tensor; sums are float32")
        return h.detach().view(torch.int16).numpy(), h
    return h.detach().numpy(), h


def reduce_to_core(comms: Communicators, grads: torch.Tensor, *, participants: int) -> torch.Tensor:
    """Sum `grads` over cells 0..participants-1; the core gets the sum (others: their input)."""
    import torch
    from mpi4py import MPI

    if participants == 1:
        return grads.clone()
    comm = comms.prefix[participants]
    send, _ = _host(grads, summed=True)
    recv = send.copy() if comm.Get_rank() == 0 else None
    comm.Reduce(send, recv, op=MPI.SUM, root=0)
    if recv is None:
        return grads
    return torch.from_numpy(recv).to(grads.device)


def broadcast_from_core(comms: Communicators, flat: torch.Tensor, *, participants: int) -> None:
    """Overwrite `flat` on cells 1..participants-1 with the core's values (in place)."""
    if participants == 1:
        return
    comm = comms.prefix[participants]
    buf, host = _host(flat)
    comm.Bcast(buf, root=0)
    if host is not flat:
        flat.copy_(host)


def sum_over_replicas(comms: Communicators, t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over this cell's replicas (`comms.replicas`): replica 0 gets the sum, others
    `t`."""
    import torch
    from mpi4py import MPI

    if comms.replicas.Get_size() == 1:
        return t
    send, _ = _host(t, summed=True)
    recv = send.copy() if comms.data_rank == 0 else None
    comms.replicas.Reduce(send, recv, op=MPI.SUM, root=0)
    if recv is None:
        return t
    return torch.from_numpy(recv).to(t.device)


def broadcast_over_replicas(comms: Communicators, flat: torch.Tensor) -> None:
    """Overwrite `flat` on this cell's replicas with replica 0's values (in place)."""
    if comms.replicas.Get_size() == 1:
        return
    buf, host = _host(flat)
    comms.replicas.Bcast(buf, root=0)
    if host is not flat:
        flat.copy_(host)
