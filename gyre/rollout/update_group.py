"""The embedded engine's side of SGLang's update-group routes: parse, join, receive, leave.

SGLang 0.5.21 lets a publisher broadcast weights instead of posting them
(sglang/srt/managers/io_struct.py `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `DestroyWeightsUpdateGroupReqInput`; the model
runner's `init_weights_update_group` / `receive_weights_from_distributed`): each engine rank
joins a standalone process group at `rank_offset + tp_rank` (a TCP store at
`master_address:master_port`, namespaced by `group_name`), then, inside a weight-update
session, allocates each posted (name, dtype, shape) and receives it by broadcast from group
rank 0, in the posted order, and loads it by name — or, with ``load_format:
"flattened_bucket"`` (what Gyre sends), allocates one flat buffer of the posted tensors
(`gyre.rollout.buckets.FlatBucket`, SGLang's `FlattenedTensorBucket` layout) and receives it
in one broadcast. The embedded engine is one CPU rank, so it
joins with gloo at `rank_offset`; `gyre.rollout.server` serves the routes and
`Engine.join_update_group` / `update_weights_from_distributed` / `leave_update_group` run
these functions. The publisher's side is `gyre.rollout.serving.nccl` (the same
`open_update_group`), driven by `gyre.runtime.cell.publication.push_weights_distributed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gyre.errors import ProtocolError
from gyre.rollout.buckets import FlatBucket
from gyre.rollout.protocol import TensorSpec, UpdateGroup
from gyre.rollout.serving.nccl import open_update_group

JOIN_TIMEOUT_S = 120.0
"""How long an engine waits for the other members to join, and for each broadcast."""

_COMMON = {"rid", "http_worker_ipc"}  # SGLang's BaseReq fields, ignored
_INIT = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
_UPDATE = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
           "weight_version", "load_format", "selector", "torch_empty_cache"}  # fmt: skip
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
BUCKET = "flattened_bucket"


@dataclass(frozen=True, slots=True)
class DistributedUpdate:
    """A parsed /update_weights_from_distributed body."""

    specs: list[TensorSpec]
    group_name: str
    version: str | None
    bucketed: bool = False
    # load_format "flattened_bucket": the specs' tensors arrive as one broadcast flat buffer


def _object(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    unknown = sorted(set(body) - allowed - _COMMON)
    if unknown:
        raise ProtocolError(f"{unknown[0]}: unknown field; allowed: {', '.join(sorted(allowed))}")
    return body


def _name(body: dict[str, Any]) -> str:
    name = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"group_name: {name!r}; allowed: a non-empty string")
    return name


def parse_init(body: Any) -> tuple[UpdateGroup, int]:
    """An /init_weights_update_group body → (the group, this engine's rank_offset)."""
    b = _object(body, _INIT)
    for key in ("master_port", "rank_offset", "world_size"):
        if not isinstance(b.get(key), int) or isinstance(b.get(key), bool):
            raise ProtocolError(f"{key}: {b.get(key)!r}; allowed: an integer")
    if not isinstance(b.get("master_address"), str) or not b["master_address"]:
        raise ProtocolError(f"master_address: {b.get('master_address')!r}; allowed: a host")
    if not 1 <= b["rank_offset"] < b["world_size"]:
        raise ProtocolError(f"rank_offset: {b['rank_offset']}; allowed: 1 .. world_size - 1 "
                            f"({b['world_size'] - 1}; rank 0 is the publisher)")  # fmt: skip
    backend = b.get("backend", "nccl")
    if backend != "gloo":
        raise ProtocolError(f"backend: {backend!r}; the embedded engine runs on CPU: allowed gloo")
    group = UpdateGroup(master_address=b["master_address"], master_port=b["master_port"],
                        world_size=b["world_size"], group_name=_name(b), backend="gloo")  # fmt: skip
    return group, b["rank_offset"]


def parse_update(body: Any) -> DistributedUpdate:
    """An /update_weights_from_distributed body → names, dtypes and shapes as `TensorSpec`s."""
    b = _object(body, _UPDATE)
    names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ProtocolError("names, dtypes, shapes: expected three lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise ProtocolError(f"names, dtypes, shapes: lengths {len(names)}, {len(dtypes)}, "
                            f"{len(shapes)}; allowed: equal")  # fmt: skip
    if b.get("load_format") not in (None, BUCKET):
        raise ProtocolError(f"load_format: {b['load_format']!r}; allowed: null (one broadcast "
                            f"per tensor) or {BUCKET!r} (one flat buffer)")  # fmt: skip
    version = b.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ProtocolError(f"weight_version: {version!r}; allowed: a string or null")
    specs = [_spec(n, d, s) for n, d, s in zip(names, dtypes, shapes)]
    return DistributedUpdate(specs=specs, group_name=_name(b), version=version,
                             bucketed=b.get("load_format") == BUCKET)  # fmt: skip


def _spec(name: Any, dtype: Any, shape: Any) -> TensorSpec:
    if not isinstance(name, str):
        raise ProtocolError(f"names: {name!r}; allowed: strings")
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ProtocolError(f"tensor {name!r}: dtype {dtype!r}; allowed: a torch dtype name "
                            "(float32, bfloat16, float16, ...)")  # fmt: skip
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"tensor {name!r}: shape {shape!r}; allowed: a list of sizes")
    return TensorSpec(name, dtype, tuple(shape))


def parse_destroy(body: Any) -> str:
    """A /destroy_weights_update_group body → the group's name."""
    return _name(_object(body, {"group_name"}))


def check_specs(model: nn.Module, specs: Sequence[TensorSpec]) -> None:
    """Refuse (before any tensor is received) a name the model lacks, a shape it does not
    have, or a dtype that is not floating point."""
    targets = model.state_dict(keep_vars=True)
    for s in specs:
        if s.name not in targets:
            raise ProtocolError(f"tensor {s.name!r}: no such weight in the model")
        if s.shape != tuple(targets[s.name].shape):
            raise ProtocolError(f"tensor {s.name!r}: shape {s.shape} != model's "
                                f"{tuple(targets[s.name].shape)}")  # fmt: skip
        if not getattr(torch, s.dtype).is_floating_point:
            raise ProtocolError(f"tensor {s.name!r}: dtype {s.dtype!r}; allowed: a floating "
                                "point dtype (the model's weights are)")  # fmt: skip


def join(group: UpdateGroup, rank_offset: int) -> Any:
    """Join `group` at `rank_offset` (blocks until every member has joined)."""
    return open_update_group(group, rank=rank_offset, timeout=JOIN_TIMEOUT_S)


def receive(pg: Any, req: DistributedUpdate) -> list[tuple[str, torch.Tensor]]:
    """Receive the update's tensors by broadcast from group rank 0: one flat buffer for a
    bucket (`FlatBucket.empty`, the publisher's layout), else each spec's tensor in order."""
    import torch.distributed as dist

    if req.bucketed:
        bucket = FlatBucket.empty(req.specs)
        dist.broadcast(bucket.flat, src=0, group=pg)
        return bucket.named()
    named = []
    for s in req.specs:
        t = torch.empty(s.shape, dtype=getattr(torch, s.dtype))
        dist.broadcast(t, src=0, group=pg)
        named.append((s.name, t))
    return named


def leave(pg: Any) -> None:
    """Destroy this member's side of a group."""
    import torch.distributed as dist

    dist.destroy_process_group(pg)
