"""Control of a running rollout server: role switches, reroutes, weight publication.

`ManagedEngine` drives one server through `EngineClient` with the control calls SGLang
(0.5.21, `gyre.rollout.protocol`'s procedures) and Gyre's embedded engine share, and
tracks the `weight_version` each engine serves, confirmed from `GET /model_info` after
every publication:

    engine = ManagedEngine("cell1", url, tensor_parallel=2)
    await engine.release()                      # rollout -> training: pause (abort), release
    await engine.resume()                       # training -> rollout: resume, continue
    await engine.abort_all()                    # reroute: in-flight calls end with "abort"
    await engine.publish_tensors(named, "7")    # /update_weights_from_tensor (by value)
    await engine.init_update_group(group, 1)    # update-group path (NCCL or gloo)
    await engine.update_from_distributed(specs, group, "8")   # while the core broadcasts
    await engine.destroy_update_group(group)    # leave it (one group per publication)

A publication pauses generation (mode "retract") and opens a weight-update session
(`/begin_weight_update` … `/end_weight_update`, then `/continue_generation`): SGLang refuses
weight updates outside a session, and without the pause it waits for every call in flight
to finish. Request bodies use SGLang's field names (`init_update_group_body`,
`distributed_update_body`; tests/gpu/test_gpu_sglang_bodies.py checks them against SGLang's
own request types).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gyre.errors import EngineError
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import (
    Call,
    release_procedure,
    resume_procedure,
    weight_update_procedure,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class UpdateGroup:
    """A weight-update process group: the core at rank 0, engines' ranks after it."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "gyre_weights"
    backend: str = "nccl"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What an engine must allocate to receive one broadcast tensor."""

    name: str
    dtype: str  # "bfloat16", "float32", ...
    shape: tuple[int, ...]


def tensor_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def init_update_group_body(group: UpdateGroup, rank_offset: int) -> dict[str, Any]:
    """SGLang's InitWeightsUpdateGroupReqInput."""
    return {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }


def distributed_update_body(
    specs: Sequence[TensorSpec], group_name: str, version: str, *, flush_cache: bool = True
) -> dict[str, Any]:
    """SGLang's UpdateWeightsFromDistributedReqInput."""
    return {
        "names": [s.name for s in specs],
        "dtypes": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": version,
    }


def destroy_update_group_body(group_name: str) -> dict[str, Any]:
    """SGLang's DestroyWeightsUpdateGroupReqInput."""
    return {"group_name": group_name}


class ManagedEngine:
    """One rollout server as the coordinator sees it."""

    def __init__(
        self, engine_id: str, base_url: str, *, tensor_parallel: int = 1, timeout: float = 3600.0
    ) -> None:
        self.engine_id = engine_id
        self.base_url = base_url.rstrip("/")
        self.client = EngineClient(self.base_url, engine_id=engine_id, timeout=timeout)
        self.tensor_parallel = tensor_parallel
        self.weight_version: str | None = None
        self.released = False

    async def refresh_version(self) -> str:
        self.weight_version = await self.client.weight_version()
        return self.weight_version

    async def release(self, tags: Sequence[str] | None = None) -> None:
        """Rollout -> training: abort in-flight calls (pause "abort"), free weights and KV."""
        await self.client.run(release_procedure(tags))
        self.released = True

    async def resume(self, tags: Sequence[str] | None = None) -> None:
        """Training -> rollout: take the memory back (weights as they were at release:
        SGLang needs --enable-weights-cpu-backup for that) and continue generation."""
        await self.client.run(resume_procedure(tags))
        self.released = False

    async def abort(self, rid: str) -> None:
        await self.client.abort(rid)

    async def abort_all(self) -> None:
        await self.client.abort_all()

    async def publish_tensors(
        self, named: Iterable[tuple[str, torch.Tensor]], version: str
    ) -> None:
        """`/update_weights_from_tensor` (tensors by value), then confirm the version."""
        await self.client.update_weights_from_tensor(named, version, tp_size=self.tensor_parallel)
        await self._confirm(version)

    async def init_update_group(self, group: UpdateGroup, rank_offset: int) -> None:
        """Join the core's weight-update group (blocks until every member has joined)."""
        call = Call("/init_weights_update_group", init_update_group_body(group, rank_offset))
        await self.client.control(call)

    async def update_from_distributed(
        self, specs: Sequence[TensorSpec], group: UpdateGroup, version: str
    ) -> None:
        """Receive `specs` by broadcast from group rank 0; returns when loaded."""
        body = distributed_update_body(specs, group.group_name, version)
        update = Call("/update_weights_from_distributed", body)
        await self.client.run(weight_update_procedure(update))
        await self._confirm(version)

    async def destroy_update_group(self, group: UpdateGroup) -> None:
        """Leave `group` (the engine destroys its side)."""
        call = Call("/destroy_weights_update_group", destroy_update_group_body(group.group_name))
        await self.client.control(call)

    async def _confirm(self, version: str) -> None:
        got = await self.refresh_version()
        if got != version:
            raise EngineError(
                f"engine {self.engine_id}: serves weight_version {got!r} after publishing {version!r}"
            )
