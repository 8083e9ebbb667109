"""The core's side of `/update_weights_from_distributed`: a standalone group and broadcasts.

At start the core (group rank 0) and every engine rank (ranks `rank_offset ..`) meet in a
process group of their own, created beside any other torch.distributed state (a TCP store at
`master_address:master_port`, namespaced by the group name, the way SGLang's engines build
their side). At burst end the core posts the tensor specs to every engine and broadcasts
the tensors in the same order:

    group = UpdateGroup(master_address=host, master_port=port, world_size=1 + sum(tps))
    pg = await connect_engines(clients, tps, group)        # clients: `EngineClient`s
    await publish_distributed(clients, pg, group, named_hf_tensors, version="8")

`named_hf_tensors` are in the engines' (Hugging Face) layout: `gyre.train.megatron.weights.
mcore_to_hf` for the Megatron backend, the model's own state dict for the torch backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from gyre.errors import EngineError
from gyre.rollout.protocol import UpdateGroup, tensor_specs

if TYPE_CHECKING:
    from gyre.rollout.client import EngineClient


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Engine i's first rank in the group, and the group's world size (core = rank 0)."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        if tp < 1:
            raise EngineError(f"engine tensor_parallel: {tp}; allowed >= 1")
        offsets.append(nxt)
        nxt += tp
    return offsets, nxt


def open_update_group(group: UpdateGroup, *, rank: int = 0, timeout: float = 600.0) -> Any:
    """Create (collectively with the other members) a standalone process group."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    td = timedelta(seconds=timeout)
    url = f"tcp://{group.master_address}:{group.master_port}"
    store, rank, world = next(c10d.rendezvous(url, rank, group.world_size, timeout=td))
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


async def connect_engines(
    engines: Sequence[EngineClient], tp_sizes: Sequence[int], group: UpdateGroup
) -> Any:
    """Every engine joins `group` while the core creates its side; returns the core's group."""
    offsets, world = rank_offsets(tp_sizes)
    if world != group.world_size:
        raise EngineError(f"update group world_size {group.world_size} != 1 + engine ranks {world}")
    loop = asyncio.get_running_loop()
    core = loop.run_in_executor(None, open_update_group, group)
    await asyncio.gather(*(e.init_update_group(group, o) for e, o in zip(engines, offsets)))
    return await core


async def publish_distributed(
    engines: Sequence[EngineClient],
    pg: Any,
    group: UpdateGroup,
    named: Sequence[tuple[str, torch.Tensor]],
    version: str,
) -> None:
    """Post the specs to every engine and broadcast the tensors; versions are confirmed."""
    specs = tensor_specs(named)
    loop = asyncio.get_running_loop()
    sending = loop.run_in_executor(None, broadcast_tensors, pg, [t for _, t in named])
    await asyncio.gather(
        *(e.update_weights_from_distributed(specs, group, version) for e in engines)
    )
    await sending
    await asyncio.gather(*(e.confirm_version(version) for e in engines))
