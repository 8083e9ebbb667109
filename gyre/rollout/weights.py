"""Weight movement for the embedded engine: the tensor wire formats, in-place loads, offload.

Wire format of `/update_weights_from_tensor` (SGLang's `UpdateWeightsFromTensorReqInput`):
``serialized_named_tensors`` holds one payload per tensor-parallel rank (the embedded
engine has one), each what SGLang's ``MultiprocessingSerializer.deserialize`` reads: the
base64 text of a pickle. Two ``load_format``s are taken:

* ``"flattened_bucket"`` (what Gyre sends): a pickle of ``{"flattened_tensor": uint8 vector,
  "metadata": [records]}``, one `gyre.rollout.buckets.FlatBucket` (SGLang's
  ``_update_weights_from_flattened_bucket``). `serialize_bucket` pickles the buffer *by
  handle* with ``ForkingPickler`` and torch's multiprocessing reductions, as SGLang's own
  serializer does — a CUDA IPC handle on GPU; on CPU, a shared-memory file descriptor passed
  by `multiprocessing.resource_sharer` over a Unix socket (the body carries a few hundred
  bytes, not the weights) — or *by value* (pickle's own tensor reduction, ``by_handle``
  False: engines on other nodes below `engine.distributed_above_mb`).
* ``null`` (SGLang: the model's own ``load_weights``): a pickle of ``(name, tensor)`` pairs
  by value; read for clients that send it, no longer sent by Gyre.

**Handles across unrelated processes.** The resource sharer hands a descriptor only to a
client that passes its handshake with the sender's ``multiprocessing`` authkey; an engine
is not a multiprocessing child of the rank that publishes, so both set their authkey from
the run's engine key (`share_key`): a process without the key cannot fetch the memory. The
publisher keeps the buffer (and the shared descriptor) alive until the engine has answered
the call, then `release_handles` closes any descriptor no engine fetched (a lost engine).
`deserialize_named_tensors` / `deserialize_bucket` are the embedded engine's readers: a
restricted unpickler admitting exactly the globals these formats refer to.

Release / resume of memory occupation (SGLang frees GPU memory for colocated training):
`offload` swaps every parameter and buffer for a meta-device placeholder and returns a
snapshot of the originals; `restore` puts them back. On CPU the snapshot stays in process
memory, so nothing is returned to the OS; what matters is that the engine refuses to
generate until resumed and comes back with exactly the weights it had.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import multiprocessing
import pickle
import re
from collections.abc import Mapping, Sequence
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import torch
from torch import nn
from torch.multiprocessing import reductions

from gyre.errors import ProtocolError
from gyre.rollout.buckets import FlatBucket
from gyre.rollout.protocol import Call, engine_key, tensor_update_call

NamedTensors = list[tuple[str, torch.Tensor]]
BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, BUCKET)
_SHARE_SALT = b"gyre weight handles\0"


def share_key() -> None:
    """Set this process's `multiprocessing` authkey from the run's engine key, on the
    publishing rank and in the engine alike, so that the engine passes the handshake of the
    publisher's resource sharer (module doc); a run without a key shares a fixed one (its
    engines' routes are unauthenticated then too)."""
    key = hashlib.sha256(_SHARE_SALT + (engine_key() or "").encode()).digest()
    if multiprocessing.current_process().authkey != key:
        resource_sharer.stop()  # a listener started under another key would refuse the engine
        multiprocessing.current_process().authkey = key


def release_handles() -> None:
    """After a movement: close the descriptors no engine fetched (it died or refused the call
    first); the sharer's thread starts again with the next handle."""
    resource_sharer.stop()


def serialize_bucket(bucket: FlatBucket, *, by_handle: bool) -> str:
    """One flattened_bucket payload: base64 of a pickle of ``{"flattened_tensor",
    "metadata"}``, the buffer by handle (`ForkingPickler`: CUDA IPC, or a CPU buffer's
    shared-memory descriptor, `FlatBucket.pack(shared=True)`) or by value."""
    payload = {"flattened_tensor": bucket.flat, "metadata": bucket.wire_metadata()}
    buf = io.BytesIO()
    if by_handle:
        share_key()
        ForkingPickler(buf, pickle.DEFAULT_PROTOCOL).dump(payload)
    else:
        payload["flattened_tensor"] = _by_value(bucket.flat)
        pickle.Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def bucket_call(bucket: FlatBucket, version: str | None, *, tp_size: int, by_handle: bool) -> Call:
    """The /update_weights_from_tensor call that loads `bucket` on an engine of `tp_size` TP
    ranks: SGLang's TP rank r deserializes payload r only (`TpModelWorker.
    deserialize_own_rank`), and each serialization of a CUDA tensor takes its own IPC
    reference, so every rank gets a payload of its own (the whole tensors: each rank shards
    them in its model's `load_weights`)."""
    assert tp_size >= 1, tp_size  # EngineConfig / ServerConfig refuse tensor_parallel < 1
    payloads = [serialize_bucket(bucket, by_handle=by_handle) for _ in range(tp_size)]
    return tensor_update_call(payloads, version, load_format=BUCKET)


def _by_value(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def decode_update(body: Any) -> tuple[NamedTensors, str | None, bool]:
    """Read an /update_weights_from_tensor body → (named tensors, weight_version, flush_cache).
    A flattened bucket's tensors are views into the received buffer (shared with the
    publisher when sent by handle): load them before the reply."""
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    load_format = body.get("load_format")
    if load_format not in LOAD_FORMATS:
        raise ProtocolError(f"load_format: {load_format!r}; allowed: null (the model's own "
                            f"names) or {BUCKET!r}")  # fmt: skip
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
        raise ProtocolError("serialized_named_tensors: expected a list of base64 strings")
    if len(payloads) != 1:
        raise ProtocolError(
            f"serialized_named_tensors: {len(payloads)} payloads; allowed: exactly one (the "
            "embedded engine is a single tensor-parallel rank, tensor_parallel 1: one payload "
            "per TP rank is SGLang's format)"
        )
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ProtocolError(f"weight_version: {version!r}; allowed: a string or null")
    flush = body.get("flush_cache", True)
    if not isinstance(flush, bool):
        raise ProtocolError(f"flush_cache: {flush!r}; allowed: true or false")
    if load_format == BUCKET:
        return deserialize_bucket(payloads[0]).named(), version, flush
    return deserialize_named_tensors(payloads[0]), version, flush


def _unpickle(payload: str, what: str) -> Any:
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("serialized_named_tensors[0]: not base64 text") from None
    share_key()  # a handle's descriptor is fetched from the publisher during the load
    try:
        return _TensorUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # pickle errors, refused globals, truncated data, a dead sender ...
        raise ProtocolError(f"serialized_named_tensors[0]: not a pickle of {what} ({e})") from None


def deserialize_bucket(payload: str) -> FlatBucket:
    """Read one flattened_bucket payload (by handle or by value); ProtocolError otherwise."""
    raw = _unpickle(payload, "a flattened bucket")
    if not isinstance(raw, dict) or set(raw) != {"flattened_tensor", "metadata"}:
        raise ProtocolError("serialized_named_tensors[0]: expected a dict with exactly "
                            "flattened_tensor and metadata (SGLang's flattened_bucket)")  # fmt: skip
    return FlatBucket.from_wire(raw["flattened_tensor"], raw["metadata"],
                               "serialized_named_tensors[0]")  # fmt: skip


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """Read one load_format null payload; ProtocolError if it is anything else."""
    raw = _unpickle(payload, "(name, tensor) pairs")
    if not isinstance(raw, list) or not all(
        isinstance(p, list | tuple)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in raw
    ):
        raise ProtocolError("serialized_named_tensors[0]: expected a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in raw]


def _load_storage(data: bytes) -> Any:
    """`torch.storage._load_from_bytes`, without its unrestricted `torch.load`."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


class _LocalDupFd(resource_sharer.DupFd):
    """A shared descriptor's ticket, restored only if it names a Unix socket (the sender's
    resource sharer on this node): a payload cannot make the engine dial a TCP address."""

    def __setstate__(self, state: Any) -> None:
        ident = state.get("_id") if isinstance(state, dict) else None
        if not (isinstance(ident, tuple) and len(ident) == 2 and isinstance(ident[0], str)
                and isinstance(ident[1], int)):  # fmt: skip
            raise pickle.UnpicklingError("a shared descriptor must name a Unix socket path")
        self._id = ident


def _rebuild_storage_fd(cls: Any, df: Any, size: Any) -> Any:
    if cls is not torch.UntypedStorage or not isinstance(df, _LocalDupFd):
        raise pickle.UnpicklingError("a shared storage must be an UntypedStorage by descriptor")
    return reductions.rebuild_storage_fd(cls, df, size)


class _TensorUnpickler(pickle.Unpickler):
    """Admits only the globals the two payload formats refer to.

    By value: tensors rebuilt from storage bytes (`_load_storage`). By handle: torch's
    multiprocessing rebuilders of a tensor over a storage, the storage mapped from a
    descriptor the publisher's resource sharer hands over (`_rebuild_storage_fd`, tickets
    limited to Unix sockets: `_LocalDupFd`) or, on GPU, opened from a CUDA IPC handle
    (`rebuild_cuda_tensor`). None of these runs code named by the payload, or reads anything
    but memory its sender chose to share: what a payload can reach is the memory of a
    process holding the run's engine key (the resource sharer's handshake, `share_key`), and
    only a caller holding that key reaches the route at all (the server answers 401 without
    it, `gyre.rollout.protocol.authorized`; the engine binds its rank's own address). The
    metadata records are SimpleNamespaces of str, int, `torch.Size` and dtypes."""

    ALLOWED: ClassVar = {
        ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
        ("types", "SimpleNamespace"), ("torch", "Size"), ("torch", "Tensor"),
        ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    }  # fmt: skip
    REPLACED: ClassVar = {
        ("torch.storage", "_load_from_bytes"): _load_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _rebuild_storage_fd,
        ("multiprocessing.resource_sharer", "DupFd"): _LocalDupFd,
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.REPLACED:
            return self.REPLACED[(module, name)]
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
"""A routed expert's projection as a checkpoint names it (one tensor per expert)."""


def from_stacked_experts(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """Checkpoint tensor `name` of routed expert j (``...mlp.experts.{j}.gate_proj.weight``)
    as a view into transformers 5's stacked ``gate_up_proj`` (gate rows first) or
    ``down_proj`` among `tensors`; None where `name` is no such tensor."""
    m = EXPERT.fullmatch(name)
    if m is None:
        return None
    base, j, proj = m.group(1), int(m.group(2)), m.group(3)
    stacked = tensors.get(f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if stacked is None or j >= stacked.shape[0]:
        return None
    if proj == "down_proj":
        return stacked[j]
    return stacked[j].chunk(2, dim=0)[proj == "up_proj"]


STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")
"""A mixture-of-experts layer's routed experts as transformers 5's modules stack them."""


def checkpoint_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Transformers 5's stacked routed experts (``mlp.experts.gate_up_proj``, ``mlp.experts.
    down_proj``) as a checkpoint names them, one tensor per expert and projection (views, no
    copy: `from_stacked_experts`) — what SGLang's `load_weights` maps; every other tensor as
    it is. The inverse of `gyre.train.megatron.weights.module_names`."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        m = STACKED.fullmatch(name)
        if m is None or t.dim() != 3:
            out.append((name, t))
            continue
        projs = ("down_proj",) if m.group(2) == "down_proj" else ("gate_proj", "up_proj")
        for j in range(t.shape[0]):
            for proj in projs:
                each = f"{m.group(1)}.{j}.{proj}.weight"
                piece = from_stacked_experts({name: t}, each)
                assert piece is not None  # `each` is one of `name`'s experts
                out.append((each, piece))
    return out


def load_named_tensors(model: nn.Module, named: NamedTensors) -> None:
    """Copy tensors into the model in place; checks every name and shape before writing any.

    A name is the model's own or, as SGLang also takes them, a checkpoint's: a mixture-of-
    experts layer's routed experts one tensor each (``mlp.experts.3.up_proj.weight``), copied
    into their rows of the model's stacked ``gate_up_proj`` / ``down_proj`` (a policy read
    from its safetensors files is named so)."""
    params = model.state_dict(keep_vars=True)
    targets: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        target = params.get(name)
        if target is None:
            target = from_stacked_experts(params, name)
        if target is None:
            close = [k for k in params if k.endswith(name.rsplit(".", 1)[-1])][:5]
            raise ProtocolError(f"tensor {name!r}: no such weight in the model; similar: {close}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ProtocolError(
                f"tensor {name!r}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise ProtocolError(f"tensor {name!r}: contains NaN or infinite values")
        targets[name] = target
    with torch.no_grad():
        for name, tensor in named:
            targets[name].copy_(tensor)


Snapshot = list[tuple[nn.Module, str, str, Any]]


def offload(model: nn.Module) -> Snapshot:
    """Replace all parameters and buffers by meta placeholders; return the originals."""
    snapshot: Snapshot = []
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(module, kind)
            for name, t in list(slots.items()):
                if t is None:
                    continue
                snapshot.append((module, kind, name, t))
                meta = torch.empty_like(t, device="meta")
                slots[name] = (
                    nn.Parameter(meta, requires_grad=False) if kind == "_parameters" else meta
                )
    return snapshot


def restore(snapshot: Snapshot) -> None:
    """Undo `offload` (tied weights come back as the same shared objects)."""
    for module, kind, name, t in snapshot:
        getattr(module, kind)[name] = t
