"""The torch training backend: every rank of a cell holds the whole model (`train.backend`).

Data parallel inside a cell: a pass's rows are split over the cell's ranks, the leader's
optimizer steps the cell's summed gradient and the cell receives the result; the leader's
model *is* the Hugging Face policy (what engines load, policies save, checkpoints keep).
The embedded default, CPU or GPU; docs/training.md.

    replica = TORCH.build(cfg.model, cfg.train, dims, core=True, device="cpu")
    replica.named()            # HF-layout weights of the version held

Torch is imported when a replica is built or used, not with this module (the registry is
imported by the run config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.errors import ConfigError
from gyre.train import core_file
from gyre.train.backends.protocol import TrainBackend
from gyre.train.config import ParallelConfig, ParallelDims

if TYPE_CHECKING:
    import torch

    from gyre.train.cell import CoreOptimizer, TorchCell
    from gyre.train.comm import Communicators
    from gyre.train.config import TrainConfig


@dataclass(slots=True)
class TorchReplica:
    """The whole model on this rank (data parallel in a cell)."""

    cell: TorchCell
    tokenizer: Any
    optimizer: CoreOptimizer | None
    dims: ParallelDims

    @property
    def policy_model(self) -> Any:
        """The Hugging Face model of the weights held (the leader's): saved as a policy."""
        return self.cell.model

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The leader's HF-layout weights (what engines load)."""
        return [(n, p.detach()) for n, p in self.policy_model.named_parameters()]

    def refresh(self) -> None:
        """After the weights changed (collective over the cell): the torch replica is its
        own policy model, nothing to gather."""

    def hf_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        """A flat buffer (parameters or gradients) in the HF model's flat order, on the
        leader (collective over the cell)."""
        return flat

    def optimizer_state(self) -> dict[str, Any] | None:
        """The core's AdamW state dict with its moments in the HF model's flat order, on the
        leader (collective over a model-parallel core); None without an optimizer."""
        return self.optimizer.opt.state_dict() if self.optimizer is not None else None

    def save(self, folder: Path, version: int, shard: int) -> int:
        """This rank's part of a checkpoint (the leader writes it); bytes written."""
        state = self.optimizer_state()
        if shard != 0:
            return 0
        return core_file.save(folder, self.named(), state, version)

    def restore(self, folder: Path) -> int:
        """Load checkpoint directory `folder` in place (the core: its optimizer too);
        returns its version."""
        from gyre.rollout.weights import load_named_tensors

        data = core_file.load(folder)
        load_named_tensors(self.cell.model, data["named"])
        if self.optimizer is not None and data["optimizer"] is not None:
            self.optimizer.opt.load_state_dict(data["optimizer"])
        return int(data["version"])


def build(
    model: str, train: TrainConfig, dims: ParallelDims, *, core: bool, device: str,
    comms: Communicators | None = None, host: str = "127.0.0.1",
) -> TorchReplica:  # fmt: skip
    """The whole Hugging Face model on this rank (the cell's ranks are data parallel)."""
    import torch

    from gyre.models import load_model
    from gyre.train.cell import CoreOptimizer, TorchCell

    hf, tokenizer = load_model(model)
    module: torch.nn.Module = hf
    module.to(torch.device(device)).train()
    cell = TorchCell(hf, objective=train.objective)
    optimizer = CoreOptimizer(cell, train.optim) if core else None
    return TorchReplica(cell, tokenizer, optimizer, dims)


def data_parallel(parallel: ParallelConfig, ranks_per_cell: int) -> ParallelDims:
    """Every rank a whole replica: tensor and pipeline sizes must be 1."""
    if (parallel.tensor or 1) != 1 or parallel.pipeline != 1:
        raise ConfigError(
            f"parallel: tensor {parallel.tensor}, pipeline {parallel.pipeline} with backend "
            "torch; allowed: tensor 1 (or null) and pipeline 1 — the torch backend is "
            "data parallel inside a cell (train.backend megatron shards the model)"
        )
    return ParallelDims(tensor=1, pipeline=1, data=ranks_per_cell)


TORCH = TrainBackend(name="torch", build=build, dims=data_parallel, every_core_rank_steps=False)
"""The torch backend: the core's leader steps, the cell receives its weights."""
