"""Weight snapshots from the core to joining satellites: Mooncake Transfer Engine or MPI.

The core exposes one flat host buffer holding its authoritative weights (for a CPU model the
parameter buffer itself; for a CUDA model a host mirror refreshed by `expose()` after every
update). A satellite *pulls* it one-sidedly, without interrupting the core's training:

* ``mooncake`` — every cell rank runs a `mooncake.engine.TransferEngine` (TCP on one machine,
  RDMA on clusters; P2P handshake, no metadata server); the core registers its buffer and
  broadcasts (session, address, size) at start; `pull` is `transfer_sync_read`.
  Needs `pip install mooncake-transfer-engine-non-cuda` and Debian `libibverbs1`.
* ``mpi`` — an MPI window over the core's buffer (collective `Win.Create` at start); `pull` is
  a passive-target `Lock(SHARED) / Get / Unlock`.

In a cell of R ranks every rank of the core exposes its buffer and satellite rank s pulls
from core rank s: a snapshot moves shard by shard, over R links at once.

Both are created collectively over `world` by every process (coordinator included):

    snap = make_transport("mooncake", comms.world, core_ranks=[2, 3], shard=1,
                          flat=cell.flat_params)
    snap.pull(cell.flat_params)      # on a satellite: from world rank 3
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from gyre.errors import ConfigError, TrainingError
from gyre.train.comm import arrive

if TYPE_CHECKING:  # torch only where tensors move: the coordinator and proxy never import it
    import torch

TransportKind = Literal["mooncake", "mpi"]


class SnapshotTransport(Protocol):
    """What a cell needs from a snapshot transport."""

    def expose(self, flat: torch.Tensor) -> None: ...
    def pull(self, into: torch.Tensor) -> float: ...
    def progress(self) -> None: ...
    def close(self) -> None: ...


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a host tensor, as a numpy view (any dtype: numpy has no bfloat16)."""
    import torch

    return t.detach().view(torch.uint8).numpy()


def _host_buffer(flat: torch.Tensor | None) -> np.ndarray:
    if flat is None:
        return np.zeros(0, np.uint8)
    if flat.device.type == "cpu":
        return _bytes(flat)
    return np.empty(flat.numel() * flat.element_size(), np.uint8)


def _copy_into(into: torch.Tensor, host: np.ndarray) -> None:
    if into.device.type != "cpu":
        import torch

        into.copy_(torch.from_numpy(host).view(into.dtype).to(into.device))


class MpiSnapshot:
    """Snapshot pull through an MPI window on the core's buffer."""

    def __init__(
        self, world: Any, *, core_ranks: list[int], shard: int, flat: torch.Tensor | None
    ) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._world = world
        self.core_rank = core_ranks[shard % len(core_ranks)]  # where this rank pulls from
        is_core = world.Get_rank() in core_ranks
        self._buf = _host_buffer(flat if is_core else None)
        self._local = _host_buffer(flat) if flat is not None and not is_core else None
        arrive(world)  # the core may still be building its replica: wait without spinning
        # the size of the core shard this rank pulls (pipeline stages differ in size)
        self.nbytes = world.allgather(self._buf.nbytes if is_core else None)[self.core_rank]
        self.win = MPI.Win.Create(self._buf if self._buf.nbytes else None, 1, comm=world)

    def expose(self, flat: torch.Tensor) -> None:
        """Core: refresh the exposed buffer (only needed for device-resident weights)."""
        if flat.device.type != "cpu":
            self._buf[:] = _bytes(flat.detach().cpu())

    def progress(self) -> None:
        """Core: serve pulls waiting on this rank (call it often while idle).

        MPICH completes a passive-target Get only when the target itself enters an MPI call
        on the window (measured: a Get on a core idling outside MPI took as long as the
        idle, 6 s of 6; with this every 50 ms, 0.16 s); generic progress (Iprobe) does not
        help. A lock of its own window is the cheapest such call."""
        if self._buf.nbytes:
            me = self._world.Get_rank()
            self.win.Lock(me, self._mpi.LOCK_SHARED)
            self.win.Unlock(me)

    def pull(self, into: torch.Tensor) -> float:
        """Satellite: copy the core's weights into `into`; returns seconds taken."""
        t0 = time.perf_counter()
        host = _bytes(into) if into.device.type == "cpu" else self._local
        if host is None or host.nbytes != self.nbytes:
            raise TrainingError(f"snapshot: local buffer does not match the core's {self.nbytes} B")
        self.win.Lock(self.core_rank, self._mpi.LOCK_SHARED)
        self.win.Get(host, self.core_rank)
        self.win.Unlock(self.core_rank)
        _copy_into(into, host)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Collective: free the window (ranks stop at different times: arrive quietly first)."""
        arrive(self._world)
        self.win.Free()


class MooncakeSnapshot:
    """Snapshot pull through Mooncake Transfer Engine (TCP here, RDMA on clusters)."""

    def __init__(
        self, world: Any, *, core_ranks: list[int], shard: int, flat: torch.Tensor | None,
        host: str = "127.0.0.1",
    ) -> None:  # fmt: skip
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ConfigError(
                "transport: mooncake needs `pip install mooncake-transfer-engine-non-cuda` "
                f"and Debian libibverbs1 ({e}); or use transport=mpi"
            ) from None
        self.engine: Any = None
        self._buf = _host_buffer(flat)
        if flat is not None:
            self.engine = TransferEngine()
            if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
                raise TrainingError("mooncake: TransferEngine.initialize failed")
            if self.engine.register_memory(self._buf.ctypes.data, self._buf.nbytes) != 0:
                raise TrainingError("mooncake: register_memory failed")
        mine = None
        if world.Get_rank() in core_ranks:
            mine = (f"{host}:{self.engine.get_rpc_port()}", self._buf.ctypes.data, self._buf.nbytes)
        arrive(world)  # the core may still be building its replica: wait without spinning
        every = world.allgather(mine)
        self.session, self.remote_ptr, self.nbytes = every[core_ranks[shard % len(core_ranks)]]

    def expose(self, flat: torch.Tensor) -> None:
        """Core: refresh the registered buffer (only needed for device-resident weights)."""
        if flat.device.type != "cpu":
            self._buf[:] = _bytes(flat.detach().cpu())

    def progress(self) -> None:
        """Nothing to do: Mooncake serves reads from its own threads."""

    def pull(self, into: torch.Tensor) -> float:
        """Satellite: read the core's registered buffer into ours; returns seconds taken."""
        if self.engine is None or self._buf.nbytes != self.nbytes:
            raise TrainingError(f"snapshot: local buffer does not match the core's {self.nbytes} B")
        t0 = time.perf_counter()
        rc = self.engine.transfer_sync_read(
            self.session, self._buf.ctypes.data, self.remote_ptr, self.nbytes
        )
        if rc != 0:
            raise TrainingError(f"mooncake: transfer_sync_read from {self.session} returned {rc}")
        _copy_into(into, self._buf)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Unregister the buffer."""
        if self.engine is not None:
            self.engine.unregister_memory(self._buf.ctypes.data)


def make_transport(
    kind: str, world: Any, *, core_ranks: list[int], shard: int, flat: torch.Tensor | None,
    host: str = "127.0.0.1",
) -> SnapshotTransport:  # fmt: skip
    """Collective over `world`: the snapshot transport `kind` ("mooncake" | "mpi").

    `core_ranks`: world ranks of the core cell, by shard; `shard`: this rank's position in
    its cell (it pulls from the core's rank at the same position); `host`: the name peers reach
    this rank by (Mooncake; 127.0.0.1 while the world is on one host)."""
    if kind == "mpi":
        return MpiSnapshot(world, core_ranks=core_ranks, shard=shard, flat=flat)
    if kind == "mooncake":
        return MooncakeSnapshot(world, core_ranks=core_ranks, shard=shard, flat=flat, host=host)
    raise ConfigError(f"transport: {kind!r}; allowed mooncake, mpi")
