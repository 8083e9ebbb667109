"""Weight movement for the embedded engine: the CPU wire format, in-place loads, offload.

Wire format of `/update_weights_from_tensor` on the embedded engine (SGLang's field names;
SGLang itself ships CUDA IPC handles in `serialized_named_tensors`, which cannot cross
machines or work on CPU): ``serialized_named_tensors`` is a list with one element per
tensor-parallel rank (the embedded engine has one); each element is the base64 text of a
``torch.save`` of a list of ``(name, tensor)`` pairs, read back with
``torch.load(weights_only=True)``. ``load_format`` must be absent, null or ``"torch_save"``.
Names are the model's ``state_dict`` keys (tied weights may be named either way).

Release / resume of memory occupation (SGLang frees GPU memory for colocated training):
`offload` swaps every parameter and buffer for a meta-device placeholder and returns a
snapshot of the originals; `restore` puts them back. On CPU the snapshot stays in process
memory, so nothing is returned to the OS; what matters is that the engine refuses to
generate until resumed and comes back with exactly the weights it had.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gyre.errors import ProtocolError

NamedTensors = list[tuple[str, torch.Tensor]]
LOAD_FORMATS = (None, "torch_save")


def encode_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Serialize (name, tensor) pairs for `serialized_named_tensors` (base64 torch.save)."""
    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu().contiguous()) for name, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_update(body: Any) -> tuple[NamedTensors, str | None, bool]:
    """Read an /update_weights_from_tensor body → (named tensors, weight_version, flush_cache)."""
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    if body.get("load_format") not in LOAD_FORMATS:
        raise ProtocolError(
            f"load_format: {body.get('load_format')!r}; allowed: null or 'torch_save'"
        )
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
        raise ProtocolError(
            "serialized_named_tensors: expected a list with one base64 string (one TP rank)"
        )
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ProtocolError(f"weight_version: {version!r}; allowed: a string or null")
    flush = body.get("flush_cache", True)
    if not isinstance(flush, bool):
        raise ProtocolError(f"flush_cache: {flush!r}; allowed: true or false")
    return _decode_payload(payloads[0]), version, flush


def _decode_payload(payload: str) -> NamedTensors:
    try:
        raw = torch.load(io.BytesIO(base64.b64decode(payload, validate=True)), weights_only=True)
    except Exception as e:  # binascii.Error, pickle errors, zip errors ...
        raise ProtocolError(
            f"serialized_named_tensors[0]: not a base64 torch.save payload ({e})"
        ) from None
    items = list(raw.items()) if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not all(
        isinstance(p, list | tuple)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in items
    ):
        raise ProtocolError("serialized_named_tensors[0]: expected a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in items]


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
