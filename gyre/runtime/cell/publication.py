"""A publication sent from the ranks that hold the weights: every sender's part to every
engine, inside one weight-update session per engine.

A cell's weights are in parts (`Replica.part`): a torch cell's leader holds the whole model
and is its only sender; in a Megatron cell each pipeline stage's sender (TP rank 0 of data
replica 0) holds its stage's tensors, gathered inside the stage's tensor-parallel group and
converted to the engines' names (`gyre.train.megatron.weights.stage_to_hf`), so no rank —
the leader included — gathers another stage's weights to publish them. A publication is
collective over the cell (`publish_parts`):

1. the leader opens a session on every target engine that answers /health (pause
   "retract", /begin_weight_update) — SGLang takes weight updates only inside one, and the
   engines serve nothing half-loaded;
2. the senders, one after the other in stage order, each send their own part to every
   live engine by their own route (`engine_host.route`, from the sender's own address):
   by handle to an engine on the sender's node, through an update group of the sender's
   own to the others — the sender at group rank 0, where SGLang's receivers broadcast from
   (`update_weights_from_distributed` receives with ``src=0``); SGLang keeps groups by name,
   so a publication of S stages opens S groups, each joined, used and destroyed in turn —,
   or by value below `engine.distributed_above_mb`;
3. the leader closes every session (/end_weight_update, continue) and confirms the version
   (/model_info). An engine that is down, refuses, or fails any sender's part is missed,
   never fatal: the coordinator has it reload.

    missed = publish_parts(comms.cell, replica.part(shard), targets, version, cfg.engine, host)
    missed = publish(targets, named, version, cfg.engine, host)   # one sender: the whole model

A cell's own engine behind the weights the cell holds (the core back in rollout, any cell's
engine after a resume) is loaded the same way (`reload_parts`), never from a copy of the
whole model on one rank.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import torch

from gyre.errors import EngineError
from gyre.rollout.buckets import bucketed
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import (
    DEFAULT_BUCKET_MB,
    Procedure,
    UpdateGroup,
    update_session_procedure,
)
from gyre.rollout.serving.nccl import broadcast_tensors, listen, open_update_group, rank_offsets
from gyre.rollout.weights import BUCKET
from gyre.runtime.cell.engine_host import engine_names, handle_device, push_weights, route
from gyre.runtime.shared.config import EngineConfig
from gyre.train.comm import Alone, arrive

log = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]
Targets = Sequence[tuple[int, str]]
TIMEOUT_S = 120.0
"""The update group's rendezvous and each broadcast; HTTP control calls get 5x that."""
POLL_S = 0.005
"""The longest sleep of a rank waiting for the others to finish their part (`arrive`)."""


def publish(targets: Targets, named: Named, version: int, config: EngineConfig,
            host: str) -> list[int]:  # fmt: skip
    """Push `named` as `version` from this process to every target engine; returns the
    engines that missed it (the one-sender case of `publish_parts`)."""
    missed = publish_parts(Alone(), named, targets, version, config, host)
    assert missed is not None
    return missed


def publish_parts(comm: Any, part: Named | None, targets: Targets, version: int,
                  config: EngineConfig, host: str) -> list[int] | None:  # fmt: skip
    """Collective over `comm` (an MPI communicator of the cell, rank 0 its leader): every
    rank holding a `part` sends it, in rank order, to the target engines the leader opened a
    session on, from `host` (the rank's own address). The leader returns the engines that
    missed the publication; the other ranks None."""
    leader = comm.Get_rank() == 0
    opened = asyncio.run(_open(targets)) if leader else None
    arrive(comm, POLL_S)  # the others sleep meanwhile (MPICH's collectives spin a core)
    live = comm.bcast(opened[0] if opened is not None else None, root=0)
    failed: list[int] = []
    for sender, sends in enumerate(comm.allgather(part is not None)):
        if sends and sender == comm.Get_rank():
            assert part is not None
            failed = send_part(live, part, version, config, host)
        if sends:  # one sender at a time: each engine loads one part after another
            arrive(comm, POLL_S)
    failures = comm.gather(failed, root=0)
    if opened is None:
        return None
    failed = sorted({e for f in failures for e in f})
    return sorted({*opened[1], *asyncio.run(_close(live, failed, str(version)))})


def reload_parts(comm: Any, part: Callable[[], Named | None], targets: Targets, version: int,
                 config: EngineConfig, host: str) -> list[int] | None:  # fmt: skip
    """Collective over `comm` (a cell's communicator, rank 0 its leader): bring the engines
    of `targets` (the leader's: its own engine where it is behind the cell's weights, else
    none) to `version`, the weights the cell holds, by a publication from the ranks that hold
    them (`publish_parts`). Every rank learns from the leader whether there is anything to
    load, so `part()` (a stage's gather) runs only then. The leader returns the engines that
    missed the weights; the others None."""
    leader = comm.Get_rank() == 0
    arrive(comm, POLL_S)  # the others sleep while the leader resumes or starts its engine
    if not comm.bcast(bool(targets) if leader else None, root=0):
        return [] if leader else None
    return publish_parts(comm, part(), targets, version, config, host)


def send_part(live: Targets, part: Named, version: int, config: EngineConfig,
              host: str) -> list[int]:  # fmt: skip
    """Send `part` to every engine of `live` (each inside a session the leader opened) by
    its route from `host`; returns the engines it failed to reach."""
    nbytes = sum(t.numel() * t.element_size() for _, t in part)
    named = engine_names(config, part)
    how = {e: route(config, urlsplit(url).hostname or "", host, nbytes=nbytes) for e, url in live}
    grouped = [(e, url) for e, url in live if how[e] == "group"]
    failed = asyncio.run(_group_send(grouped, named, str(version), config.tensor_parallel, host,
                                     config.bucket_bytes)) if grouped else []  # fmt: skip
    for engine, url in live:
        if how[engine] == "group":
            continue
        try:
            push_weights(url, named, version, tp_size=config.tensor_parallel,
                         by_handle=how[engine] == "handle", bucket_bytes=config.bucket_bytes,
                         device=handle_device(config), session=False)  # fmt: skip
        except EngineError:
            failed.append(engine)
    return failed


def push_weights_distributed(
    targets: Targets, named: Named, version: int, *, tp_size: int, host: str,
    bucket_bytes: int = DEFAULT_BUCKET_MB << 20, timeout: float = TIMEOUT_S,
) -> list[int]:  # fmt: skip
    """Publish `named` as `version` from this process to every (engine, url) in `targets`
    through one update group made for this publication; returns the engines that missed it.

    The engines that answer /health open a session; this process (group rank 0, rendezvous
    at `host`: its own address) opens the group while each engine joins at its rank offset,
    and bucket by bucket (at most `bucket_bytes` each) every engine takes an
    `/update_weights_from_distributed` call with load_format "flattened_bucket" while this
    process broadcasts the bucket's flat buffer once to all of them; then both sides destroy
    the group, the sessions close and the version is confirmed. An engine that is down,
    refuses, dies or times out (`timeout` bounds the rendezvous and each broadcast) is
    missed, and so is every engine once a bucket failed anywhere (the collective cannot go
    on)."""

    async def run() -> list[int]:
        live, missed = await _open(targets, timeout)
        failed = await _group_send(live, named, str(version), tp_size, host, bucket_bytes,
                                   timeout) if live else []  # fmt: skip
        return sorted({*missed, *await _close(live, failed, str(version), timeout)})

    return asyncio.run(run())


def _clients(targets: Targets, timeout: float) -> dict[int, EngineClient]:
    return {e: EngineClient(url, engine_id=str(e), timeout=5 * timeout) for e, url in targets}


async def _each(clients: dict[int, EngineClient], call: Any) -> list[int]:
    """Run `call(client)` on every client at once; the engines whose call failed."""
    done = await asyncio.gather(*(call(c) for c in clients.values()), return_exceptions=True)
    return [e for e, d in zip(clients, done) if isinstance(d, BaseException)]


async def _open(targets: Targets, timeout: float = TIMEOUT_S) -> tuple[Targets, list[int]]:
    """Open a weight-update session (pause "retract", begin) on every target that answers
    /health: (the live targets, the engines missed)."""
    clients = _clients(targets, timeout)
    try:
        down = await _each(clients, _healthy)
        up = {e: c for e, c in clients.items() if e not in down}
        session = update_session_procedure()
        refused = await _each(up, lambda c: c.run(Procedure(session.calls)))
        missed = set(down) | set(refused)
        return [(e, url) for e, url in targets if e not in missed], sorted(missed)
    finally:
        for c in clients.values():
            c.close()


async def _healthy(client: EngineClient) -> None:
    if await client.health() is not True:
        raise EngineError(f"engine {client.engine_id}: not healthy")


async def _close(live: Targets, failed: Sequence[int], version: str,
                 timeout: float = TIMEOUT_S) -> list[int]:  # fmt: skip
    """Close every live engine's session (end, continue) and confirm that the ones no part
    failed on serve `version`; the engines that missed the publication."""
    clients = _clients(live, timeout)
    try:
        cleanup = update_session_procedure().cleanup
        unclosed = await _each(clients, lambda c: c.run(Procedure((), cleanup)))
        done = {e: c for e, c in clients.items() if e not in failed and e not in unclosed}
        unconfirmed = await _each(done, lambda c: c.confirm_version(version))
        return sorted({*failed, *unclosed, *unconfirmed})
    finally:
        for c in clients.values():
            c.close()


async def _group_send(
    targets: Targets, named: Named, version: str, tp_size: int, host: str, bucket_bytes: int,
    timeout: float = TIMEOUT_S,
) -> list[int]:  # fmt: skip
    """Send `named` to the engines of `targets` (each of `tp_size` ranks, inside an open
    session) through one update group of this process's, at group rank 0: the engines join,
    take one `/update_weights_from_distributed` per bucket while this process broadcasts it,
    and leave. Returns the engines that did not get all of it (all, once anything failed)."""
    clients = _clients(targets, timeout)
    offsets, world = rank_offsets([tp_size] * len(clients))
    store = listen(host, world, timeout)
    port = store.port
    group = UpdateGroup(master_address=host, master_port=port, world_size=world,
                        group_name=f"gyre_weights_v{version}_{port}",
                        backend="nccl" if named and named[0][1].is_cuda else "gloo")  # fmt: skip
    loop = asyncio.get_running_loop()
    core = loop.run_in_executor(
        None, lambda: open_update_group(group, timeout=timeout, store=store)
    )
    try:
        joins = await asyncio.gather(
            *(c.init_update_group(group, o) for c, o in zip(clients.values(), offsets)), core,
            return_exceptions=True)  # fmt: skip
        pg = joins[-1]
        ok = not any(isinstance(j, BaseException) for j in joins)
        for bucket in bucketed(named, max_bytes=bucket_bytes) if ok else ():
            sending = loop.run_in_executor(None, broadcast_tensors, pg, [bucket.flat])
            done = await asyncio.gather(
                *(c.update_weights_from_distributed(bucket.specs(), group, version,
                                                    load_format=BUCKET) for c in clients.values()),
                sending, return_exceptions=True)  # fmt: skip
            if any(isinstance(d, BaseException) for d in done):
                ok = False
                break
        await asyncio.gather(*(c.destroy_update_group(group) for c in clients.values()),
                             return_exceptions=True)  # fmt: skip
        if not isinstance(pg, BaseException):
            _destroy(pg)
        return [] if ok else list(clients)
    finally:
        for c in clients.values():
            c.close()


def _destroy(pg: Any) -> None:
    """Free this process's side of a group; a group broken by a lost engine may refuse."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError) as e:
        log.warning("update group: destroy failed (%s)", e)
