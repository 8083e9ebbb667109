"""A cell's rollout engine as a child process of the cell rank.

The engine (`engine.backend`: the embedded engine, `python -m gyre.rollout.cli`, or an SGLang
server; both launched from the `gyre.rollout.serving.config` presets, with the run's engine
key) runs in its own process so that it can be killed (SIGKILL, OOM) without taking the MPI
world down: the cell notices the exit, reports the loss, and restarts it on request. The
cell drives it with `EngineClient`'s calls made blocking (`gyre.rollout.client.blocking`:
the cell rank has no event loop): release (pause in mode "abort", then
`release_memory_occupation`) and resume (`resume_memory_occupation`, then
`continue_generation`) on role switches, and `update_weights_from_tensor`
(`gyre.rollout.weights.publish_procedure`) to publish. Failures are `EngineError`s
(refused, reset, timed out, an HTTP error, a control call answered ``success: false``).

The core publishes to all the cells' engines in one of two ways (`EngineConfig.publication`):
`push_weights`, base64 HTTP bodies (one per TP rank) to each engine in turn, or
`push_weights_distributed`, one update group per publication (the core at rank 0, every
engine's ranks after it; gloo on CPU, NCCL when the tensors are on CUDA) over which the
tensors are broadcast once to all engines (SGLang's `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import torch

from gyre.errors import ConfigError, EngineError
from gyre.rollout.buckets import bucketed
from gyre.rollout.client import EngineClient, blocking
from gyre.rollout.protocol import (
    DEFAULT_BUCKET_MB,
    Procedure,
    UpdateGroup,
    release_procedure,
    resume_procedure,
    update_session_procedure,
)
from gyre.rollout.serving.config import ServerConfig
from gyre.rollout.serving.nccl import broadcast_tensors, open_update_group, rank_offsets
from gyre.rollout.serving.process import EngineProcess
from gyre.rollout.weights import BUCKET
from gyre.runtime.shared.config import EngineConfig
from gyre.schedule.devices import EnginePace

log = logging.getLogger(__name__)


class EngineHost(EngineProcess):
    """A cell's engine: the process, started from the run's `EngineConfig` at the weight
    version it serves, and the blocking control calls the cell makes to it.

    Starting, readiness and stopping are `EngineProcess`'s (one implementation for every
    engine Gyre starts); this class adds what only a cell needs: the launch from the run's
    config (offline Hugging Face hub, torch threads, `labels` in its environment), the
    address it binds and is reached at (`host`: the rank's, `gyre.runtime.shared.address`), the
    weight version it serves (a restarted engine is launched at it) and whether it is
    released.
    """

    def __init__(
        self,
        model: str,
        config: EngineConfig,
        log_path: Path,
        version: int,
        labels: dict[str, str] | None = None,
        pace: EnginePace | None = None,
        host: str = "127.0.0.1",
        base_gpu_id: int = 0,
        routed_experts: bool = False,
        node_rank: int = 0,
        dist_init_addr: str = "",
    ) -> None:
        self.model, self.engine_config = model, config
        self.node_rank, self.dist_init_addr = node_rank, dist_init_addr  # engine.nodes > 1
        self.routed_experts = routed_experts  # SGLang: capture them (routing replay)
        self.host = host  # bound and advertised: the rank's address (gyre.runtime.shared.address)
        self.base_gpu_id = base_gpu_id  # its first GPU (gyre.runtime.shared.placement)
        self.pace = pace  # paced (`PaceConfig.engine`): the embedded engine's --pace
        self.labels = labels or {}  # extra environment: lets operators and tests find it
        self.version = version
        self.released = False
        super().__init__(self._server(), log_path=log_path)

    def _server(self) -> ServerConfig:
        server = self.engine_config.server(self.model, self.version, host=self.host,
                                           base_gpu_id=self.base_gpu_id,
                                           routed_experts=self.routed_experts,
                                           node_rank=self.node_rank,
                                           dist_init_addr=self.dist_init_addr)  # fmt: skip
        if self.pace is not None:
            if server.launch != "embedded":
                raise ConfigError("pace: only the embedded engine is paced (engine.backend)")
            server = dataclasses.replace(
                server, extra_args=[*server.extra_args, "--pace", self.pace.to_json()]
            )
        env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(self.engine_config.threads),
               **self.labels}  # fmt: skip
        return dataclasses.replace(server, env=env)

    def spawn(self) -> None:
        """Start the process at the version the engine serves (returns at once)."""
        self.config = self._server()
        super().spawn()
        self.released = False

    def release(self) -> None:
        """Abort every outstanding call and drop KV caches and weights (ROLLOUT -> TRAIN)."""
        blocking(self.url, lambda client: client.run(release_procedure()))
        self.released = True

    def resume(self) -> None:
        """Restore the weights the engine had and let it generate again (TRAIN -> ROLLOUT)."""
        blocking(self.url, lambda client: client.run(resume_procedure()))
        self.released = False

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Load weights of `version` into the engine (a reload, respawn or resume). The
        engine is this rank's child, on its node: the weights go by handle where handles
        reach it (`route`), in buckets."""
        how = route(self.engine_config, self.host, self.host, nbytes=_nbytes(named))
        named = engine_names(self.engine_config, named)
        push_weights(self.url, named, version, tp_size=self.engine_config.tensor_parallel,
                     by_handle=how == "handle", bucket_bytes=self.engine_config.bucket_bytes,
                     device=handle_device(self.engine_config))  # fmt: skip
        self.version = version


Route = Literal["handle", "group", "value"]


def engine_names(
    config: EngineConfig, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """The policy's tensors named as `config`'s engine loads them: SGLang maps a checkpoint's
    names (a mixture-of-experts model's experts one tensor each: `checkpoint_names`), the
    embedded engine loads the transformers model's own (stacked experts)."""
    if config.backend != "sglang":
        return named
    from gyre.rollout.weights import checkpoint_names

    return checkpoint_names(named)


def route(config: EngineConfig, engine_host: str, host: str, *, nbytes: int) -> Route:
    """How weights of `nbytes` reach an engine bound to `engine_host` from a rank at `host`
    (`engine.publication`): auto sends to an engine on this node by handle, to one on another
    node through an update group (by value below `engine.distributed_above_mb`); distributed
    sends every engine through an update group, http every engine by value."""
    if config.publication == "http":
        return "value"
    if config.publication == "distributed" or config.nodes > 1:
        return "group"  # a multi-node engine's other nodes hold no handle of this node's
    if engine_host == host and handle_device(config) != "none":
        return "handle"
    return "group" if config.distributed(nbytes) else "value"


def handle_device(config: EngineConfig) -> str | None:
    """Where a bucket sent by handle is packed: the tensors' own device for the embedded
    engine (CPU shared memory, or CUDA IPC); CUDA for SGLang, whose processes cannot fetch a
    CPU descriptor (they are not started with the run's authkey, `weights.share_key`), so a
    CPU mirror's buckets are staged on the GPU; "none" where neither reaches it."""
    if config.backend != "sglang":
        return None
    return "cuda" if torch.cuda.is_available() else "none"


def _nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def push_weights(
    url: str, named: list[tuple[str, torch.Tensor]], version: int, *, tp_size: int,
    by_handle: bool = False, bucket_bytes: int = DEFAULT_BUCKET_MB << 20,
    device: str | None = None,
) -> None:  # fmt: skip
    """Publish `named` as `version` on the engine at `url`, served by `tp_size` TP ranks, in
    buckets of at most `bucket_bytes` (packed on `device`, default the tensors'), by handle
    or by value.

    SGLang's TP rank r reads payload r of the body (`TpModelWorker.deserialize_own_rank`,
    sglang/srt/managers/tp_worker.py), so an engine with `--tp-size` 2 needs two payloads;
    the embedded engine (`tp_size` 1) takes exactly one."""
    blocking(
        url,
        lambda client: client.update_weights_from_tensor(
            named, str(version), tp_size=tp_size, by_handle=by_handle,
            bucket_bytes=bucket_bytes, device=None if device == "none" else device),
        timeout=600,
    )  # fmt: skip


def publish(
    targets: Sequence[tuple[int, str]], named: list[tuple[str, torch.Tensor]], version: int,
    config: EngineConfig, host: str,
) -> list[int]:  # fmt: skip
    """Push a publication to every target engine; returns the engines that missed it.

    Each engine's weights go by `route`: by handle to the engines on this node, through one
    update group broadcast to all the others (or by value, below the threshold). A refused,
    reset or timed-out push (the engine died or is dying) is a miss, never fatal: the
    coordinator has it reload."""
    tp, nbytes = config.tensor_parallel, _nbytes(named)
    named = engine_names(config, named)
    how = {e: route(config, urlsplit(url).hostname or "", host, nbytes=nbytes)
           for e, url in targets}  # fmt: skip
    grouped = [(e, url) for e, url in targets if how[e] == "group"]
    missed = push_weights_distributed(grouped, named, version, tp_size=tp, host=host,
                                      bucket_bytes=config.bucket_bytes) if grouped else []  # fmt: skip
    for engine, url in targets:
        if how[engine] == "group":
            continue
        try:
            push_weights(url, named, version, tp_size=tp, by_handle=how[engine] == "handle",
                         bucket_bytes=config.bucket_bytes, device=handle_device(config))  # fmt: skip
        except EngineError:
            missed.append(engine)
    return missed


def push_weights_distributed(
    targets: Sequence[tuple[int, str]],
    named: list[tuple[str, torch.Tensor]],
    version: int,
    *,
    tp_size: int,
    host: str,
    bucket_bytes: int = DEFAULT_BUCKET_MB << 20,
    timeout: float = 120.0,
) -> list[int]:
    """Publish `named` as `version` to every (engine, url) in `targets` through one update
    group made for this publication; returns the engines that missed it.

    The core (this process, group rank 0, rendezvous at `host`: the rank's own address)
    opens the group while every engine that answers /health joins at its rank offset; each
    engine then opens a weight-update session (pause, begin), and bucket by bucket (at most
    `bucket_bytes` each) takes an `/update_weights_from_distributed` call with load_format
    "flattened_bucket" while the core broadcasts the bucket's flat buffer once to all of
    them; then the sessions close (end, continue) and both sides destroy the group. An
    engine that is down, refuses, dies or times out (`timeout` bounds the group's rendezvous
    and each broadcast; HTTP calls get 5x that) is reported missed, like a failed
    `push_weights`, and so is every engine once a bucket failed anywhere (the collective
    cannot go on); the core is never left waiting longer."""
    return asyncio.run(_distributed(targets, named, str(version), tp_size, host, timeout,
                                    bucket_bytes))  # fmt: skip


async def _distributed(
    targets: Sequence[tuple[int, str]], named: list[tuple[str, torch.Tensor]], version: str,
    tp_size: int, host: str, timeout: float, bucket_bytes: int,
) -> list[int]:  # fmt: skip
    engines = {e: EngineClient(url, engine_id=str(e), timeout=5 * timeout) for e, url in targets}
    try:
        up = await asyncio.gather(*(c.health() for c in engines.values()),
                                  return_exceptions=True)  # fmt: skip
        live = [c for c, ok in zip(engines.values(), up) if ok is True]
        got = (await _broadcast(live, tp_size, named, version, host, timeout, bucket_bytes)
               if live else set())  # fmt: skip
        return [e for e, c in engines.items() if c.engine_id not in got]
    finally:
        for c in engines.values():
            c.close()


async def _broadcast(
    live: list[EngineClient], tp_size: int, named: list[tuple[str, torch.Tensor]],
    version: str, host: str, timeout: float, bucket_bytes: int,
) -> set[str]:  # fmt: skip
    """The engines of `live` (each of `tp_size` ranks) that loaded `named` through one update
    group and serve `version` (their ids)."""
    offsets, world = rank_offsets([tp_size] * len(live))
    port = _free_port(host)
    group = UpdateGroup(master_address=host, master_port=port, world_size=world,
                        group_name=f"gyre_weights_v{version}_{port}",
                        backend="nccl" if named and named[0][1].is_cuda else "gloo")  # fmt: skip
    loop = asyncio.get_running_loop()
    core = loop.run_in_executor(None, lambda: open_update_group(group, timeout=timeout))
    joins = await asyncio.gather(*(c.init_update_group(group, o) for c, o in zip(live, offsets)),
                                 core, return_exceptions=True)  # fmt: skip
    pg = joins[-1]
    if any(isinstance(j, BaseException) for j in joins):  # no group: every engine missed it
        if not isinstance(pg, BaseException):
            _destroy(pg)
        return set()
    session = update_session_procedure()
    opened = await asyncio.gather(*(c.run(Procedure(session.calls)) for c in live),
                                  return_exceptions=True)  # fmt: skip
    ok = not any(isinstance(o, BaseException) for o in opened)
    for bucket in bucketed(named, max_bytes=bucket_bytes) if ok else ():
        sending = loop.run_in_executor(None, broadcast_tensors, pg, [bucket.flat])
        done = await asyncio.gather(
            *(c.update_weights_from_distributed(bucket.specs(), group, version,
                                                load_format=BUCKET) for c in live),
            sending, return_exceptions=True)  # fmt: skip
        if any(isinstance(d, BaseException) for d in done):
            ok = False
            break
    await asyncio.gather(*(c.run(Procedure((), session.cleanup)) for c in live),
                         return_exceptions=True)  # fmt: skip
    await asyncio.gather(*(c.destroy_update_group(group) for c in live), return_exceptions=True)
    _destroy(pg)
    if not ok:
        return set()
    confirmed = await asyncio.gather(*(c.confirm_version(version) for c in live),
                                     return_exceptions=True)  # fmt: skip
    return {c.engine_id for c, d in zip(live, confirmed) if not isinstance(d, BaseException)}


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _destroy(pg: Any) -> None:
    """Free the core's side of a group; a group broken by a lost engine may refuse."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError) as e:
        log.warning("update group: destroy failed (%s)", e)
