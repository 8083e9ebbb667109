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

A publication (the core's weights to every rollout engine) is `gyre.runtime.cell.publication`'s:
sent from the ranks that hold the weights, by each one's route (`route`) — by handle to an
engine on its node, through an update group to the others (gloo on CPU, NCCL when the
tensors are on CUDA), by value below the threshold — in buckets (`push_weights`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from gyre.errors import ConfigError
from gyre.rollout.client import blocking
from gyre.rollout.protocol import (
    DEFAULT_BUCKET_MB,
    release_procedure,
    resume_procedure,
)
from gyre.rollout.serving.config import ServerConfig
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
    CPU descriptor (they are not started with the run's authkey, `weights.share_key`), so
    weights held on the host (a parked trainer's part) are staged on the GPU bucket by
    bucket; "none" where neither reaches it."""
    if config.backend != "sglang":
        return None
    return "cuda" if torch.cuda.is_available() else "none"


def _nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def push_weights(
    url: str, named: list[tuple[str, torch.Tensor]], version: int, *, tp_size: int,
    by_handle: bool = False, bucket_bytes: int = DEFAULT_BUCKET_MB << 20,
    device: str | None = None, session: bool = True,
) -> None:  # fmt: skip
    """Publish `named` as `version` on the engine at `url`, served by `tp_size` TP ranks, in
    buckets of at most `bucket_bytes` (packed on `device`, default the tensors'), by handle
    or by value; inside a weight-update session of its own, or (`session` False) inside one
    the caller opened (a publication of several senders' parts).

    SGLang's TP rank r reads payload r of the body (`TpModelWorker.deserialize_own_rank`,
    sglang/srt/managers/tp_worker.py), so an engine with `--tp-size` 2 needs two payloads;
    the embedded engine (`tp_size` 1) takes exactly one."""
    blocking(
        url,
        lambda client: client.update_weights_from_tensor(
            named, str(version), tp_size=tp_size, by_handle=by_handle,
            bucket_bytes=bucket_bytes, device=None if device == "none" else device,
            session=session),
        timeout=600,
    )  # fmt: skip
