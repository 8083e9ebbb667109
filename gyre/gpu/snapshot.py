"""Pinned-memory weight snapshots and the training cell's memory release on role switch.

`PinnedSnapshot` keeps a host copy of a device buffer in page-locked memory (when CUDA is
present), so device→host and host→device copies run at full PCIe/NVLink-C2C speed and
asynchronously on a stream; on CPU it is an ordinary copy:

    snap = PinnedSnapshot.like(cell.flat_params)
    snap.capture(cell.flat_params)      # non-blocking D2H; snap.wait() before reading
    snap.restore_into(cell.flat_params)

`CellOffload` implements the TRAIN→ROLLOUT switch of a `TorchCell` whose weights live on the
GPU: `release(cell)` copies `flat_params` into a pinned snapshot, points every parameter and
its grad at empty tensors and drops the flat buffers, so `torch.cuda.empty_cache()` returns
their memory; `resume(cell)` reallocates the buffers, copies the weights back and re-views
the parameters exactly as `gyre.train.cell.flatten_parameters` laid them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gyre.errors import TrainingError
from gyre.train.cell import TorchCell


class PinnedSnapshot:
    """A host mirror of one device tensor (page-locked when CUDA is available)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self._event: torch.cuda.Event | None = None

    @classmethod
    def like(cls, t: torch.Tensor) -> PinnedSnapshot:
        pin = torch.cuda.is_available()
        return cls(torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin))

    @property
    def pinned(self) -> bool:
        return bool(self.host.is_pinned())

    def capture(self, src: torch.Tensor) -> None:
        """Copy `src` into the snapshot (asynchronous from CUDA; `wait()` before use)."""
        if src.shape != self.host.shape or src.dtype != self.host.dtype:
            raise TrainingError(
                f"snapshot: {tuple(src.shape)}/{src.dtype} != {tuple(self.host.shape)}/{self.host.dtype}"
            )
        self.host.copy_(src, non_blocking=src.is_cuda and self.pinned)
        if src.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def restore_into(self, dst: torch.Tensor) -> None:
        self.wait()
        dst.copy_(self.host, non_blocking=dst.is_cuda and self.pinned)
        if dst.is_cuda:
            torch.cuda.current_stream(dst.device).synchronize()


@dataclass(slots=True)
class CellOffload:
    """A cell's weights parked in host memory while its GPU serves rollout."""

    snapshot: PinnedSnapshot | None = None
    device: torch.device | None = None
    shapes: list[torch.Size] = field(default_factory=list)

    @property
    def released(self) -> bool:
        return self.snapshot is not None

    def release(self, cell: TorchCell) -> None:
        """Weights → pinned host; parameters, grads and flat buffers freed on the device."""
        if self.snapshot is not None:
            raise TrainingError("cell memory is already released")
        snap = PinnedSnapshot.like(cell.flat_params)
        snap.capture(cell.flat_params)
        snap.wait()
        self.snapshot, self.device = snap, cell.flat_params.device
        self.shapes = [p.shape for p in _trainable(cell)]
        empty = torch.empty(0, dtype=cell.flat_params.dtype, device=self.device)
        for p in _trainable(cell):
            p.data = empty
            p.grad = None
        cell.flat_params = empty
        cell.flat_grads = empty

    def resume(self, cell: TorchCell) -> None:
        """Reallocate the flat buffers on the device, reload the weights, re-view parameters."""
        if self.snapshot is None or self.device is None:
            raise TrainingError("cell memory is not released")
        host = self.snapshot.host
        flat = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.snapshot.restore_into(flat)
        grads = torch.zeros_like(flat)
        off = 0
        for p, shape in zip(_trainable(cell), self.shapes):
            n = _numel(shape)
            p.data = flat[off : off + n].view(shape)
            p.grad = grads[off : off + n].view(shape)
            off += n
        if off != flat.numel():
            raise TrainingError(f"resume: parameters cover {off} of {flat.numel()} elements")
        cell.flat_params, cell.flat_grads = flat, grads
        self.snapshot = None


def _trainable(cell: TorchCell) -> list[torch.nn.Parameter]:
    return [p for p in cell.model.parameters() if p.requires_grad]


def _numel(shape: torch.Size) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
