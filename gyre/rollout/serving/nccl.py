"""The core's side of `/update_weights_from_distributed`: a standalone group and broadcasts.

For each publication the core (group rank 0) and every engine rank (ranks `rank_offset ..`)
meet in a process group of their own, created beside any other torch.distributed state (a
TCP store at `master_address:master_port`, namespaced by the group name, the way SGLang's
engines build their side); the core posts each bucket's tensor specs to every engine and
broadcasts the bucket's flat buffer (`gyre.runtime.cell.publication.push_weights_distributed`
drives it):

    store = listen(host, world, timeout)           # the port: store.port
    pg = open_update_group(group, store=store)     # while the engines join
    broadcast_tensors(pg, [bucket.flat])           # while they receive it
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from gyre.errors import EngineError
from gyre.rollout.protocol import UpdateGroup


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Engine i's first rank in the group, and the group's world size (core = rank 0)."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        if tp < 1:
            raise EngineError(f"engine tensor_parallel: {tp}; allowed >= 1")
        offsets.append(nxt)
        nxt += tp
    return offsets, nxt


def listen(host: str, world_size: int, timeout: float) -> Any:
    """Group rank 0's TCP store, listening at `host` on the port the bind picks (`.port`): no
    window between choosing a free port and binding it in which another process takes it."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, world_size, True, timeout=timedelta(seconds=timeout),
                    wait_for_workers=False)  # fmt: skip


def open_update_group(group: UpdateGroup, *, rank: int = 0, timeout: float = 600.0,
                      store: Any = None) -> Any:  # fmt: skip
    """Create (collectively with the other members) a standalone process group; rank 0 gives
    the store it listens on (`listen`), the others meet it at the group's master address."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    td = timedelta(seconds=timeout)
    world = group.world_size
    if store is None:
        url = f"tcp://{group.master_address}:{group.master_port}"
        store, rank, world = next(c10d.rendezvous(url, rank, world, timeout=td))
    store.set_timeout(td)
    store = c10d.PrefixStore(group.group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(
        world, rank, [], c10d.Backend(group.backend), store,
        group_name=group.group_name, timeout=td, **{options: None},  # type: ignore[arg-type]
    )  # fmt: skip
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def broadcast_tensors(pg: Any, tensors: Sequence[torch.Tensor], *, src: int = 0) -> None:
    """Broadcast each tensor from group rank `src`, in order (engines receive in that order)."""
    import torch.distributed as dist

    for t in tensors:
        dist.broadcast(t.contiguous(), src=src, group=pg)
