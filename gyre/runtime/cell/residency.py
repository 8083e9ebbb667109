"""A colocated trainer's state leaving its GPU for rollout and coming back for training.

What: `TrainerResidency.release(cell, optimizer)` *parks* a cell rank's trainer: its flat
parameters, flat gradients and (on the core) the optimizer's tensors (AdamW moments, a
mixed-precision cell's float32 main weights, a Megatron optimizer's norm mask) are copied to
host memory, the model's parameters and gradients are re-viewed into the host buffers, and
the cell's cached scratch (Megatron's global memory buffer and RoPE cache:
`TorchCell.free_scratch`) is freed; `restore(cell, optimizer)` copies them back to the rank's
device, one allocation each, and re-views them there (`gyre.train.cell.view_parameters`, the
layout `flatten_parameters` made). The gradients (a switch may come with gradients
accumulated) and the core's AdamW moments are kept, and the optimizer's parameter is rebound.

Every move makes a new buffer and drops the cell's references to the old one, so after a
release nothing of the trainer references device memory any more (the old buffers are freed
with their last reference), and a restore allocates each buffer once, with no second copy
beside it. That holds
only if nobody else keeps the trainer's buffers: the rank's role and the snapshot transport
are built over a description of the flat parameters, never the buffer itself, when the
trainer moves (`gyre.runtime.roles`). On a CPU rank (tests) the "device" is the CPU and the
moves are the same, a new host buffer each way.

Why: in `colocated` placement (`gyre.runtime.shared.placement`) the trainer shares its GPU
with the cell's engine; the engine gets the memory only when the trainer has left it.

How (the plan marks the ranks that need it: `RankDevice.offload`):

    residency = TrainerResidency.for_rank(plan[me])      # None when the GPU is not shared
    residency.release(cell, optimizer)                   # at start, before the engine starts,
                                                         # and on every switch to rollout
    residency.restore(cell, optimizer)                   # on the switch to train

Every move goes through `move(what, tensor, device)` (default `move_tensor`), so a test on
CPU injects a fake device map and checks which tensors went where on each switch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gyre.errors import TrainingError
from gyre.gpu.memory import memory_stats, release_cached
from gyre.runtime.shared.placement import RankDevice
from gyre.train.cell import CoreOptimizer, TorchCell, view_parameters

Mover = Callable[[str, torch.Tensor, str], torch.Tensor]
"""(what, tensor, device) -> the tensor's contents on `device`: a new tensor (a test's fake
device map may return the same one). `what` names it: flat_params, flat_grads,
optimizer.<key>."""


def move_tensor(what: str, t: torch.Tensor, device: str) -> torch.Tensor:
    """The real mover: a new tensor on `device` with `t`'s contents (one allocation; pinned
    host memory when leaving a CUDA device). Always a new buffer, also from the CPU to the
    CPU, so the caller's last reference to `t` frees it."""
    target = torch.device(device)
    out = torch.empty(t.shape, dtype=t.dtype, device=target,
                      pin_memory=target.type == "cpu" and t.is_cuda)  # fmt: skip
    out.copy_(t)
    return out


@dataclass(slots=True)
class TrainerResidency:
    """Where one cell rank's trainer state lives: its device while training, host meanwhile."""

    device: str
    """The rank's device from the placement plan (cuda:N; cpu in tests)."""
    move: Mover = move_tensor
    host: str = "cpu"
    released: bool = False

    @classmethod
    def for_rank(cls, rank: RankDevice, move: Mover = move_tensor) -> TrainerResidency | None:
        """The residency of a rank whose GPU the engine shares; None when it needs none."""
        return cls(device=rank.device, move=move) if rank.offload else None

    def release(self, cell: TorchCell, optimizer: CoreOptimizer | None = None) -> dict[str, int]:
        """Switch to rollout: params, grads and optimizer state to host; device memory freed.
        Returns what the switch records: the bytes parked on the host and the device's
        allocated bytes before and after (`gyre.gpu.memory.memory_stats`; 0 unless the
        trainer was on a CUDA device)."""
        if self.released:
            raise TrainingError("trainer state is already released to the host")
        was_cuda = cell.flat_params.is_cuda
        before = memory_stats(self.device)["allocated"] if was_cuda else 0
        cell.free_scratch()
        parked = self._relocate(cell, optimizer, self.host)
        self.released = True
        if was_cuda:
            release_cached(self.device)
        after = memory_stats(self.device)["allocated"] if was_cuda else 0
        return {"trainer_parked_bytes": parked, "device_allocated_before": before,
                "device_allocated_after": after}  # fmt: skip

    def restore(self, cell: TorchCell, optimizer: CoreOptimizer | None = None) -> None:
        """Switch to train: the same tensors back on the rank's device, one allocation each
        (the host copies are dropped)."""
        if not self.released:
            raise TrainingError("trainer state is not released; nothing to restore")
        self._relocate(cell, optimizer, self.device)
        self.released = False

    def _relocate(self, cell: TorchCell, optimizer: CoreOptimizer | None, device: str) -> int:
        """Move the trainer's tensors to `device` (each through `self.move`); the bytes moved."""
        moved = [0]

        def move(what: str, t: torch.Tensor, to: str) -> torch.Tensor:
            moved[0] += t.numel() * t.element_size()
            return self.move(what, t, to)

        old = cell.flat_params
        flat = move("flat_params", cell.flat_params, device)
        grads = move("flat_grads", cell.flat_grads, device)
        view_parameters(cell.model, flat, grads)
        cell.flat_params, cell.flat_grads, cell.device = flat, grads, flat.device
        if optimizer is not None:
            self._relocate_optimizer(optimizer, old, flat, device, move)
        return moved[0]

    def _relocate_optimizer(
        self, optimizer: CoreOptimizer, old: torch.Tensor, flat: torch.Tensor, device: str,
        move: Mover,
    ) -> None:  # fmt: skip
        """Move the optimizer object's own tensors (`ModelParallelOptimizer`'s norm mask),
        rebind its parameter (the old flat buffer, or a mixed-precision cell's float32 main
        weights, moved) and move its state tensors; scalar state (AdamW's `step`, kept on the
        host) stays where it is."""
        for name, value in sorted(vars(optimizer).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                setattr(optimizer, name, move(f"optimizer.{name}", value, device))
        opt = optimizer.opt
        params = [p for group in opt.param_groups for p in group["params"]]
        mine = [p for p in params if p.data_ptr() == optimizer.main.data_ptr()]
        mixed = optimizer.cell.mixed  # else the optimizer steps the cell's flat buffer itself
        if len(mine) != 1 or not (mixed or mine[0].data_ptr() == old.data_ptr()):
            raise TrainingError("optimizer: does not hold exactly the cell's flat parameters")
        param = mine[0]
        param.data = move("optimizer.main", param.data, device) if mixed else flat
        state = opt.state.get(param, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = move(f"optimizer.{key}", value, device)
