"""A colocated trainer's state leaving its GPU for rollout and coming back for training.

What: `TrainerResidency.release(cell, optimizer)` moves a cell rank's flat parameters, flat
gradients and (on the core) the optimizer's tensors (AdamW moments, a Megatron optimizer's
norm mask) to host memory and re-views the
model's parameters into the host buffers; `restore(cell, optimizer)` moves them back to the
rank's device and re-views them there (`gyre.train.cell.view_parameters`, the layout
`flatten_parameters` made; a mixed-precision cell's float32 main weights move with the
optimizer). It keeps the gradients (a switch may come with gradients accumulated) and the
core's AdamW moments, and rebinds the optimizer's parameter, so no device tensor stays
referenced.

Why: in `colocated` placement (`gyre.runtime.shared.placement`) the trainer shares its GPU with the
cell's engine; the engine gets the memory back only when the trainer leaves it.

How (the plan marks the ranks that need it: `RankDevice.offload`):

    residency = TrainerResidency.for_rank(plan[me])      # None when the GPU is not shared
    residency.release(cell, optimizer)                   # on the switch to rollout
    residency.restore(cell, optimizer)                   # on the switch to train

Every move goes through `move(what, tensor, device)` (default `move_tensor`), so a test on
CPU injects a fake device map and checks which tensors went where on each switch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gyre.errors import TrainingError
from gyre.gpu.memory import release_cached
from gyre.runtime.shared.placement import RankDevice
from gyre.train.cell import CoreOptimizer, TorchCell, view_parameters

Mover = Callable[[str, torch.Tensor, str], torch.Tensor]
"""(what, tensor, device) -> the tensor's contents on `device` (a new tensor, or the same
one when it is already there). `what` names it: flat_params, flat_grads, optimizer.<key>."""


def move_tensor(what: str, t: torch.Tensor, device: str) -> torch.Tensor:
    """The real mover: a copy on `device`; pinned host memory when leaving a CUDA device."""
    target = torch.device(device)
    if t.device == target:
        return t
    if target.type == "cpu" and t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host
    return t.to(target)


@dataclass(slots=True)
class TrainerResidency:
    """Where one cell rank's trainer state lives: its device while training, host meanwhile."""

    device: str
    """The rank's device from the placement plan (cuda:N)."""
    move: Mover = move_tensor
    host: str = "cpu"
    released: bool = False

    @classmethod
    def for_rank(cls, rank: RankDevice, move: Mover = move_tensor) -> TrainerResidency | None:
        """The residency of a rank whose GPU the engine shares; None when it needs none."""
        return cls(device=rank.device, move=move) if rank.offload else None

    def release(self, cell: TorchCell, optimizer: CoreOptimizer | None = None) -> None:
        """Switch to rollout: params, grads and optimizer state to host; device memory freed."""
        if self.released:
            raise TrainingError("trainer state is already released to the host")
        was_cuda = cell.flat_params.is_cuda
        self._relocate(cell, optimizer, self.host)
        self.released = True
        if was_cuda:
            release_cached(self.device)

    def restore(self, cell: TorchCell, optimizer: CoreOptimizer | None = None) -> None:
        """Switch to train: the same tensors back on the rank's device."""
        if not self.released:
            raise TrainingError("trainer state is not released; nothing to restore")
        self._relocate(cell, optimizer, self.device)
        self.released = False

    def _relocate(self, cell: TorchCell, optimizer: CoreOptimizer | None, device: str) -> None:
        old = cell.flat_params
        flat = self.move("flat_params", cell.flat_params, device)
        grads = self.move("flat_grads", cell.flat_grads, device)
        view_parameters(cell.model, flat, grads)
        cell.flat_params, cell.flat_grads, cell.device = flat, grads, flat.device
        if optimizer is not None:
            self._relocate_optimizer(optimizer, old, flat, device)

    def _relocate_optimizer(
        self, optimizer: CoreOptimizer, old: torch.Tensor, flat: torch.Tensor, device: str
    ) -> None:
        """Move the optimizer object's own tensors (`ModelParallelOptimizer`'s norm mask),
        rebind its parameter (the old flat buffer, or a mixed-precision cell's float32 main
        weights, moved) and move its state tensors; scalar state (AdamW's `step`, kept on the
        host) stays where it is."""
        for name, value in sorted(vars(optimizer).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                setattr(optimizer, name, self.move(f"optimizer.{name}", value, device))
        opt = optimizer.opt
        params = [p for group in opt.param_groups for p in group["params"]]
        mine = [p for p in params if p.data_ptr() == optimizer.main.data_ptr()]
        mixed = optimizer.cell.mixed  # else the optimizer steps the cell's flat buffer itself
        if len(mine) != 1 or not (mixed or mine[0].data_ptr() == old.data_ptr()):
            raise TrainingError("optimizer: does not hold exactly the cell's flat parameters")
        param = mine[0]
        param.data = self.move("optimizer.main", param.data, device) if mixed else flat
        state = opt.state.get(param, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = self.move(f"optimizer.{key}", value, device)
