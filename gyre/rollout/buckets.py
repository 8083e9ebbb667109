"""Flattened weight buckets: the one way Gyre packs weights for every movement to an engine.

Large RL systems do not move a model tensor by tensor, nor as one blob: they pack consecutive
tensors into flat byte buffers of a bounded size (`engine.bucket_mb`) and move one buffer at
a time, so a movement costs one transfer per bucket and at most one bucket of extra memory.
The layout is SGLang 0.5.21's `FlattenedTensorBucket` (sglang/srt/weight_sync/tensor_bucket.py):
each tensor's bytes (`tensor.flatten().view(torch.uint8)`), concatenated in order, no padding,
with one record per tensor — ``name, shape, dtype, start_idx, end_idx, numel`` (byte offsets;
``numel`` counts bytes). Tensors keep their dtype, so a bf16 replica (`train.params_dtype`)
publishes bf16 bytes. Every path carries these buckets:

* to an engine on the same node, by handle: `gyre.rollout.weights.serialize_bucket` pickles
  ``{"flattened_tensor": flat, "metadata": [...]}`` with torch's multiprocessing reductions
  (CUDA IPC on GPU, a shared-memory file descriptor on CPU), SGLang's
  ``load_format: "flattened_bucket"`` of /update_weights_from_tensor;
* to engines on other nodes, by broadcast in an update group: the flat buffer is broadcast
  once per bucket, SGLang's ``load_format: "flattened_bucket"`` of
  /update_weights_from_distributed (the receiver allocates the same layout from the posted
  names, dtypes and shapes: `FlatBucket.empty`);
* by value (`engine.publication: http`, small models): the same payload, the flat tensor
  pickled by value.

    for bucket in bucketed(named, max_bytes=256 << 20, shared=True):
        payload = serialize_bucket(bucket)       # the engine reads bucket.named() back
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gyre.errors import ProtocolError
from gyre.rollout.protocol import DEFAULT_BUCKET_MB, TensorSpec

__all__ = ["DEFAULT_BUCKET_MB", "FlatBucket", "Slot", "bucketed", "plan"]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lies in a bucket (SGLang's `FlattenedTensorMetadata`, byte offsets)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    def to_wire(self) -> types.SimpleNamespace:
        """The record SGLang's flattened_bucket loader reads by attribute; a SimpleNamespace
        (admitted by SGLang's SafeUnpickler) needs no SGLang class on the sending side."""
        return types.SimpleNamespace(name=self.name, shape=torch.Size(self.shape),
                                     dtype=self.dtype, start_idx=self.start,
                                     end_idx=self.end, numel=self.end - self.start)  # fmt: skip


@dataclass(frozen=True, slots=True)
class FlatBucket:
    """Consecutive tensors flattened into one uint8 buffer, and where each one lies."""

    flat: torch.Tensor
    slots: tuple[Slot, ...]

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors, as views into the buffer (no copy)."""
        return [(s.name, self.flat[s.start : s.end].view(s.dtype).view(s.shape))
                for s in self.slots]  # fmt: skip

    def specs(self) -> list[TensorSpec]:
        """The names, dtypes and shapes a receiver of a broadcast allocates from."""
        return [TensorSpec(s.name, str(s.dtype).removeprefix("torch."), s.shape)
                for s in self.slots]  # fmt: skip

    def wire_metadata(self) -> list[types.SimpleNamespace]:
        return [s.to_wire() for s in self.slots]

    @classmethod
    def pack(
        cls, named: Sequence[tuple[str, torch.Tensor]], *, device: torch.device | str | None = None,
        shared: bool = False,
    ) -> FlatBucket:  # fmt: skip
        """Copy `named` into one new buffer (on `device`, default the first tensor's; on the
        CPU in shared memory when `shared`, so that a handle to it can be passed on)."""
        slots = _layout((n, tuple(t.shape), t.dtype) for n, t in named)
        dev = torch.device(device) if device is not None else named[0][1].device
        flat = torch.empty(slots[-1].end if slots else 0, dtype=torch.uint8, device=dev)
        if shared and dev.type == "cpu":
            flat.share_memory_()
        for s, (_, t) in zip(slots, named):
            flat[s.start : s.end].copy_(t.detach().reshape(-1).view(torch.uint8))
        return cls(flat, tuple(slots))

    @classmethod
    def empty(cls, specs: Sequence[TensorSpec], device: str = "cpu") -> FlatBucket:
        """The buffer a receiver of a broadcast fills (SGLang: `FlattenedTensorBucket(
        named_tensors=empties)`, the same layout)."""
        slots = _layout((s.name, s.shape, getattr(torch, s.dtype)) for s in specs)
        return cls(torch.empty(slots[-1].end if slots else 0, dtype=torch.uint8, device=device),
                   tuple(slots))  # fmt: skip

    @classmethod
    def from_wire(cls, flat: Any, metadata: Any, where: str) -> FlatBucket:
        """A received ``{"flattened_tensor", "metadata"}`` payload, checked: a uint8 vector
        and records that tile it exactly; ProtocolError naming `where` otherwise."""
        if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1):
            raise ProtocolError(f"{where}.flattened_tensor: expected a 1-D uint8 tensor")
        if not isinstance(metadata, list) or not metadata:
            raise ProtocolError(f"{where}.metadata: expected a non-empty list of records")
        slots = tuple(_slot(m, f"{where}.metadata[{i}]") for i, m in enumerate(metadata))
        ends = [0, *(s.end for s in slots)]
        if any(s.start != e for s, e in zip(slots, ends)) or ends[-1] != flat.numel():
            raise ProtocolError(f"{where}.metadata: the records do not tile the "
                                f"{flat.numel()}-byte buffer in order")  # fmt: skip
        return cls(flat, slots)


def _layout(items: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> list[Slot]:
    slots, at = [], 0
    for name, shape, dtype in items:
        size = math.prod(shape) * dtype.itemsize
        slots.append(Slot(name, tuple(int(d) for d in shape), dtype, at, at + size))
        at += size
    return slots


def _slot(m: Any, where: str) -> Slot:
    try:
        name, shape, dtype = m.name, tuple(m.shape), m.dtype
        start, end, numel = m.start_idx, m.end_idx, m.numel
    except (AttributeError, TypeError):
        raise ProtocolError(f"{where}: expected a record with name, shape, dtype, start_idx, "
                            "end_idx, numel") from None  # fmt: skip
    ints = (start, end, numel, *shape)
    if (
        not isinstance(name, str)
        or not isinstance(dtype, torch.dtype)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
    ):
        raise ProtocolError(f"{where}: name a string, dtype a torch dtype, offsets and shape "
                            "non-negative integers")  # fmt: skip
    if end - start != numel or numel != math.prod(shape) * dtype.itemsize:
        raise ProtocolError(f"{where} ({name!r}): {numel} bytes at {start}..{end} do not hold "
                            f"{list(shape)} of {dtype}")  # fmt: skip
    return Slot(name, shape, dtype, start, end)


def plan(sizes: Sequence[int], max_bytes: int) -> list[range]:
    """Consecutive index ranges whose byte sizes sum to at most `max_bytes` (a tensor larger
    than that is a bucket of its own)."""
    groups, first, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > first and total + n > max_bytes:
            groups.append(range(first, i))
            first, total = i, 0
        total += n
    if first < len(sizes):
        groups.append(range(first, len(sizes)))
    return groups


def bucketed(
    named: Sequence[tuple[str, torch.Tensor]], *, max_bytes: int,
    device: torch.device | str | None = None, shared: bool = False,
) -> Iterator[FlatBucket]:  # fmt: skip
    """`named` as buckets of at most `max_bytes`, packed one at a time (`FlatBucket.pack`)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes: {max_bytes}; allowed: >= 1")
    for group in plan([t.numel() * t.element_size() for _, t in named], max_bytes):
        yield FlatBucket.pack([named[i] for i in group], device=device, shared=shared)
