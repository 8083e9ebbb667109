"""The torch training backend: every rank of a cell holds the whole model (`train.backend`).

Data parallel inside a cell: a pass's rows are split over the cell's ranks, the leader's
optimizer steps the cell's summed gradient and the cell receives the result; the leader's
model *is* the Hugging Face policy (what engines load and policies save, in
`train.params_dtype`); checkpoints keep the optimizer's main weights (float32 under mixed
precision: docs/training.md "Mixed precision"). The embedded default, CPU or GPU.

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

    def policy_configs(self) -> tuple[Any, Any]:
        model = self.cell.model
        return model.config, getattr(model, "generation_config", None)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The leader's HF-layout weights (what engines load), in `train.params_dtype`."""
        return [(n, p.detach()) for n, p in self.cell.model.named_parameters()]

    def part(self, shard: int) -> list[tuple[str, torch.Tensor]] | None:
        """A publication's part (collective over the cell): the leader holds the whole model
        and sends it all; the other ranks (data-parallel copies) send nothing."""
        return self.named() if shard == 0 else None

    def main_named(self) -> list[tuple[str, torch.Tensor]] | None:
        """The weights a checkpoint keeps, HF layout, on the leader (collective over the
        cell; None elsewhere): a core's optimizer's main weights (float32 where the cell is
        mixed precision), else the model's."""
        flat = self.optimizer.main.detach() if self.optimizer is not None else self.cell.flat_params
        hf = self.hf_flat(flat)
        if hf is None:
            return None
        return list(core_file.views(hf, self.hf_shapes()).items())

    def hf_shapes(self) -> list[tuple[str, torch.Size]]:
        """The HF model's trainable parameters' names and shapes in its flat order."""
        return [(n, p.shape) for n, p in self.cell.model.named_parameters() if p.requires_grad]

    def hf_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        """A flat buffer (parameters or gradients) in the HF model's flat order, on the
        leader (collective over the cell)."""
        return flat

    def optimizer_state(self) -> dict[str, Any] | None:
        """The core's AdamW state dict with its moments in the HF model's flat order, on the
        leader (collective over a model-parallel core); None without an optimizer."""
        return self.optimizer.opt.state_dict() if self.optimizer is not None else None

    def save(self, folder: Path, version: int, shard: int) -> int:
        """This rank's part of a checkpoint (the leader writes it: main weights and moments,
        so a resume continues exactly); bytes written."""
        named, state = self.main_named(), self.optimizer_state()
        if shard != 0:
            return 0
        assert named is not None
        return core_file.save(folder, named, state, version)

    def restore(self, folder: Path) -> int:
        """Load checkpoint directory `folder` in place (the core: its optimizer too);
        returns its version."""
        data = core_file.load(folder)
        self._load_weights(dict(data["named"]))
        if self.optimizer is not None and data["optimizer"] is not None:
            self.optimizer.opt.load_state_dict(data["optimizer"])
        return int(data["version"])

    def _mine(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors, by its model's names, of whole HF-layout tensors: all."""
        return hf

    def _flat(self, mine: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's tensors in the order of its flat buffers (one host tensor)."""
        import torch

        return torch.cat([mine[n].reshape(-1) for n, p in self.cell.model.named_parameters()
                          if p.requires_grad])  # fmt: skip

    def _load_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """A checkpoint's weights into this rank's model (rounded to its dtype) and, on a
        core rank, exactly into its optimizer's main weights."""
        from gyre.rollout.weights import load_named_tensors

        mine = self._mine(hf)
        load_named_tensors(self.cell.model, sorted(mine.items()))
        if self.optimizer is not None:
            self.optimizer.load_main(self._flat(mine))


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
    cell = TorchCell(hf, objective=train.objective, dtype=getattr(torch, train.params_dtype))
    optimizer = CoreOptimizer(cell, train.optim) if core else None
    return TorchReplica(cell, tokenizer, optimizer, dims)


def data_parallel(parallel: ParallelConfig, ranks_per_cell: int) -> ParallelDims:
    """Every rank a whole replica: tensor, pipeline and expert sizes must be 1."""
    if ((parallel.tensor or 1) != 1 or parallel.pipeline != 1 or parallel.sequence
            or parallel.expert != 1):  # fmt: skip
        raise ConfigError(
            f"parallel: tensor {parallel.tensor}, pipeline {parallel.pipeline}, expert "
            f"{parallel.expert}, sequence {parallel.sequence} with backend torch; allowed: "
            "tensor 1 (or null), pipeline 1, expert 1 and sequence false (or null) — the torch "
            "backend is data parallel inside a cell (train.backend megatron shards the model)"
        )
    if parallel.data not in (None, ranks_per_cell):
        raise ConfigError(
            f"parallel.data: {parallel.data} with backend torch and topology.ranks_per_cell "
            f"{ranks_per_cell}; allowed: {ranks_per_cell} or null (every rank of a torch cell "
            "is a data-parallel replica)"
        )
    return ParallelDims(tensor=1, pipeline=1, data=ranks_per_cell)


TORCH = TrainBackend(name="torch", build=build, dims=data_parallel, every_core_rank_steps=False)
"""The torch backend: the core's leader steps, the cell receives its weights."""
