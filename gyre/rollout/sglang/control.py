"""Control of a running rollout server: role switches, reroutes, weight publication.

`ManagedEngine` pairs an `EngineClient` (generation, abort, health) with the control routes
SGLang and Gyre's embedded engine share, and tracks the `weight_version` each engine
serves, confirmed by `GET /get_weight_version` after every publication:

    engine = ManagedEngine("cell1", url)
    await engine.release()                      # rollout -> training: free GPU memory
    await engine.resume()                       # training -> rollout
    await engine.abort_all()                    # reroute: in-flight calls end with "abort"
    await engine.publish_tensors(named, "7")    # colocated path (/update_weights_from_tensor)
    await engine.init_update_group(group)       # NCCL path, once per engine
    await engine.update_from_distributed(specs, "8")   # while the core broadcasts

Request bodies use SGLang's field names (`init_update_group_body`, `distributed_update_body`).
The embedded engine serves `/update_weights_from_tensor` with its torch_save wire format;
SGLang expects `MultiprocessingSerializer` payloads (CUDA IPC handles), which
`sglang_tensor_payload` builds when SGLang is installed beside the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gyre.errors import EngineError
from gyre.rollout.client import EngineClient

if TYPE_CHECKING:
    import torch

MEMORY_TAGS = ("weights", "kv_cache")


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


def sglang_tensor_payload(named: Sequence[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for real SGLang (same-GPU colocated path; needs sglang)."""
    from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]

    payload = MultiprocessingSerializer.serialize(list(named), output_str=True)
    return [payload] * tp_size


class ManagedEngine:
    """One rollout server as the coordinator sees it."""

    def __init__(self, engine_id: str, base_url: str, *, timeout: float = 3600.0) -> None:
        self.engine_id = engine_id
        self.base_url = base_url.rstrip("/")
        self.client = EngineClient(self.base_url, engine_id=engine_id, timeout=timeout)
        self.timeout = timeout
        self.weight_version: str | None = None
        self.released = False

    async def _post(self, route: str, body: Any, *, timeout: float | None = None) -> Any:
        request = HTTPRequest(
            self.base_url + route, method="POST", body=json.dumps(body),
            headers={"Content-Type": "application/json"}, request_timeout=timeout or self.timeout,
        )  # fmt: skip
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as e:
            text = e.response.body.decode(errors="replace")[:500] if e.response else str(e)
            raise EngineError(f"engine {self.engine_id} {route}: HTTP {e.code}: {text}") from None
        except OSError as e:
            raise EngineError(f"engine {self.engine_id} {route}: cannot connect: {e}") from None
        reply = json.loads(response.body or b"{}")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"engine {self.engine_id} {route}: {reply.get('message', reply)}")
        return reply

    async def refresh_version(self) -> str:
        self.weight_version = await self.client.weight_version()
        return self.weight_version

    async def release(self, tags: Sequence[str] | None = None) -> None:
        """Rollout -> training: abort in-flight calls, free weights and KV cache."""
        await self._post("/release_memory_occupation", {"tags": list(tags)} if tags else {})
        self.released = True

    async def resume(self, tags: Sequence[str] | None = None) -> None:
        """Training -> rollout: take the memory back (weights as they were at release)."""
        await self._post("/resume_memory_occupation", {"tags": list(tags)} if tags else {})
        self.released = False

    async def abort(self, rid: str) -> None:
        await self.client.abort(rid)

    async def abort_all(self) -> None:
        await self.client.abort_all()

    async def publish_tensors(
        self, named: Sequence[tuple[str, torch.Tensor]], version: str
    ) -> None:
        """Colocated / CPU path: `/update_weights_from_tensor`, then confirm the version."""
        await self.client.update_weights_from_tensor(named, version)
        await self._confirm(version)

    async def init_update_group(self, group: UpdateGroup, rank_offset: int) -> None:
        """Join the core's weight-update group (blocks until every member has joined)."""
        await self._post("/init_weights_update_group", init_update_group_body(group, rank_offset))

    async def update_from_distributed(
        self, specs: Sequence[TensorSpec], group: UpdateGroup, version: str
    ) -> None:
        """Receive `specs` by broadcast from group rank 0; returns when loaded."""
        body = distributed_update_body(specs, group.group_name, version)
        await self._post("/update_weights_from_distributed", body)
        await self._confirm(version)

    async def _confirm(self, version: str) -> None:
        got = await self.refresh_version()
        if got != version:
            raise EngineError(
                f"engine {self.engine_id}: serves weight_version {got!r} after publishing {version!r}"
            )
