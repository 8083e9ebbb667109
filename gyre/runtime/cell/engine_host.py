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
from typing import Any

import torch

from gyre.errors import ConfigError, EngineError
from gyre.rollout.client import EngineClient, blocking
from gyre.rollout.protocol import (
    TensorSpec,
    UpdateGroup,
    release_procedure,
    resume_procedure,
    tensor_specs,
)
from gyre.rollout.serving.config import ServerConfig
from gyre.rollout.serving.nccl import broadcast_tensors, open_update_group, rank_offsets
from gyre.rollout.serving.process import EngineProcess
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
    ) -> None:
        self.model, self.engine_config = model, config
        self.host = host  # bound and advertised: the rank's address (gyre.runtime.shared.address)
        self.base_gpu_id = base_gpu_id  # its first GPU (gyre.runtime.shared.placement)
        self.pace = pace  # paced (`PaceConfig.engine`): the embedded engine's --pace
        self.labels = labels or {}  # extra environment: lets operators and tests find it
        self.version = version
        self.released = False
        super().__init__(self._server(), log_path=log_path)

    def _server(self) -> ServerConfig:
        server = self.engine_config.server(self.model, self.version, host=self.host,
                                           base_gpu_id=self.base_gpu_id)  # fmt: skip
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
        """Publish weights of `version` into the engine (one payload per TP rank)."""
        push_weights(self.url, named, version, tp_size=self.engine_config.tensor_parallel)
        self.version = version


def push_weights(
    url: str, named: list[tuple[str, torch.Tensor]], version: int, *, tp_size: int
) -> None:
    """Publish `named` as `version` on the engine at `url`, served by `tp_size` TP ranks.

    SGLang's TP rank r reads payload r of the body (`TpModelWorker.deserialize_own_rank`,
    sglang/srt/managers/tp_worker.py), so an engine with `--tp-size` 2 needs two payloads;
    the embedded engine (`tp_size` 1) takes exactly one."""
    blocking(
        url,
        lambda client: client.update_weights_from_tensor(named, str(version), tp_size=tp_size),
        timeout=600,
    )


def publish(
    targets: Sequence[tuple[int, str]], named: list[tuple[str, torch.Tensor]], version: int,
    config: EngineConfig, host: str,
) -> list[int]:  # fmt: skip
    """Push a publication to every target engine; returns the engines that missed it.

    The weights go as HTTP bodies to each engine, or through one update group broadcast to
    all (`engine.publication`, by size when auto). A refused, reset or timed-out push (the
    engine died or is dying) is a miss, never fatal: the coordinator has it reload."""
    tp = config.tensor_parallel
    if config.distributed(sum(t.numel() * t.element_size() for _, t in named)):
        return push_weights_distributed(targets, named, version, tp_size=tp, host=host)
    missed = []
    for engine, url in targets:
        try:
            push_weights(url, named, version, tp_size=tp)
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
    timeout: float = 120.0,
) -> list[int]:
    """Publish `named` as `version` to every (engine, url) in `targets` through one update
    group made for this publication; returns the engines that missed it.

    The core (this process, group rank 0, rendezvous at `host`: the rank's own address)
    opens the group while every engine that answers /health joins at its rank offset; each
    engine then runs the weight-update session (pause, begin, `/update_weights_from_
    distributed`, end, continue) while the core broadcasts the tensors in the posted order,
    and both sides destroy the group. An engine that is down, refuses, dies or times out
    (`timeout` bounds the group's rendezvous and each broadcast; HTTP calls get 5x that) is
    reported missed, like a failed `push_weights`; the core is never left waiting longer."""
    return asyncio.run(_distributed(targets, named, str(version), tp_size, host, timeout))


async def _distributed(
    targets: Sequence[tuple[int, str]], named: list[tuple[str, torch.Tensor]], version: str,
    tp_size: int, host: str, timeout: float,
) -> list[int]:  # fmt: skip
    engines = {e: EngineClient(url, engine_id=str(e), timeout=5 * timeout) for e, url in targets}
    try:
        up = await asyncio.gather(*(c.health() for c in engines.values()),
                                  return_exceptions=True)  # fmt: skip
        live = [c for c, ok in zip(engines.values(), up) if ok is True]
        got = await _broadcast(live, tp_size, named, version, host, timeout) if live else set()
        return [e for e, c in engines.items() if c.engine_id not in got]
    finally:
        for c in engines.values():
            c.close()


async def _broadcast(
    live: list[EngineClient], tp_size: int, named: list[tuple[str, torch.Tensor]],
    version: str, host: str, timeout: float,
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
    specs = tensor_specs(named)
    sending = loop.run_in_executor(None, broadcast_tensors, pg, [t for _, t in named])
    done = await asyncio.gather(*(_receive(c, specs, group, version) for c in live),
                                return_exceptions=True)  # fmt: skip
    await asyncio.gather(sending, *(c.destroy_update_group(group) for c in live),
                         return_exceptions=True)  # fmt: skip
    _destroy(pg)
    return {c.engine_id for c, d in zip(live, done) if not isinstance(d, BaseException)}


async def _receive(
    client: EngineClient, specs: list[TensorSpec], group: UpdateGroup, version: str
) -> None:
    """One engine's side of the broadcast: the weight-update session, then the version."""
    await client.update_weights_from_distributed(specs, group, version)
    await client.confirm_version(version)


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
