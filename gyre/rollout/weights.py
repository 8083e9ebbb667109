"""Weight movement for the embedded engine: the tensor wire format, in-place loads, offload.

Wire format of `/update_weights_from_tensor` (SGLang's `UpdateWeightsFromTensorReqInput`):
``serialized_named_tensors`` holds one payload per tensor-parallel rank (the embedded
engine has one); a payload is what SGLang's ``MultiprocessingSerializer.deserialize`` reads,
the base64 text of a pickle of a list of ``(name, tensor)`` pairs. ``load_format`` must be
null (SGLang: the model's own ``load_weights``; here: the model's ``state_dict`` names, tied
weights by either name).

SGLang's own ``MultiprocessingSerializer.serialize`` pickles with ``ForkingPickler``, whose
torch reductions put a CPU tensor in shared memory and pickle a handle to it: a file
descriptor passed by `multiprocessing.resource_sharer`, which a process that is not a
multiprocessing relative of the sender cannot open (the handshake's authkey differs:
``AuthenticationError``), or with the "file_system" sharing strategy, a /dev/shm name (a
process-wide setting, and every published weight staged in /dev/shm). So Gyre pickles CPU
tensors by value (pickle's own tensor reduction; CUDA tensors are copied to the host
first): the same envelope, which SGLang's deserializer reads (its restricted unpickler
admits ``torch.storage._load_from_bytes``, loaded with ``weights_only=True``; checked
against the real package by tests/gpu/test_gpu_sglang_bodies.py) and which crosses any two
processes. `deserialize_named_tensors` is the embedded engine's reader: a restricted
unpickler admitting exactly the globals of that format.

Release / resume of memory occupation (SGLang frees GPU memory for colocated training):
`offload` swaps every parameter and buffer for a meta-device placeholder and returns a
snapshot of the originals; `restore` puts them back. On CPU the snapshot stays in process
memory, so nothing is returned to the OS; what matters is that the engine refuses to
generate until resumed and comes back with exactly the weights it had.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from gyre.errors import ProtocolError
from gyre.rollout.protocol import Procedure, tensor_update_call, weight_update_procedure

NamedTensors = list[tuple[str, torch.Tensor]]
LOAD_FORMATS = (None,)


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` payload: base64 of a pickle of (name, tensor) pairs,
    tensors by value on the host (a view is copied out of its larger storage, since pickle
    would otherwise ship the whole storage with it)."""
    pairs = [(str(name), _by_value(t)) for name, t in named]
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def publish_procedure(
    named: Iterable[tuple[str, torch.Tensor]], version: str | None, *, tp_size: int = 1
) -> Procedure:
    """The calls that publish `named` as `version` to an engine of `tp_size` TP ranks.

    SGLang's TP rank r deserializes payload r only (`TpModelWorker.deserialize_own_rank`), so
    the body holds `tp_size` payloads; each is the same by-value pickle of the whole tensors
    (every rank shards them itself in its model's `load_weights`)."""
    assert tp_size >= 1, tp_size  # EngineConfig / ServerConfig refuse tensor_parallel < 1
    payload = serialize_named_tensors(named)
    return weight_update_procedure(tensor_update_call([payload] * tp_size, version))


def _by_value(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def decode_update(body: Any) -> tuple[NamedTensors, str | None, bool]:
    """Read an /update_weights_from_tensor body → (named tensors, weight_version, flush_cache)."""
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    if body.get("load_format") not in LOAD_FORMATS:
        raise ProtocolError(
            f"load_format: {body.get('load_format')!r}; allowed: null (the model's own names)"
        )
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
    return deserialize_named_tensors(payloads[0]), version, flush


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """Read one payload of `serialize_named_tensors`; ProtocolError if it is anything else."""
    try:
        raw = _TensorUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except (binascii.Error, ValueError):
        raise ProtocolError("serialized_named_tensors[0]: not base64 text") from None
    except Exception as e:  # pickle errors, refused globals, truncated data ...
        raise ProtocolError(
            f"serialized_named_tensors[0]: not a pickle of (name, tensor) pairs ({e})"
        ) from None
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


class _TensorUnpickler(pickle.Unpickler):
    """Admits only the globals a pickle of CPU tensors by value refers to."""

    ALLOWED: ClassVar = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


def load_named_tensors(model: nn.Module, named: NamedTensors) -> None:
    """Copy tensors into the model in place; checks every name and shape before writing any."""
    targets = model.state_dict(keep_vars=True)
    for name, tensor in named:
        if name not in targets:
            close = [k for k in targets if k.endswith(name.rsplit(".", 1)[-1])][:5]
            raise ProtocolError(f"tensor {name!r}: no such weight in the model; similar: {close}")
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ProtocolError(
                f"tensor {name!r}: shape {tuple(tensor.shape)} != model's "
                f"{tuple(targets[name].shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise ProtocolError(f"tensor {name!r}: contains NaN or infinite values")
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
