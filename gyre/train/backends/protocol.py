"""The training-backend seam: what the runtime asks of `train.backend`, one record per backend.

A `TrainBackend` is a plain record of builder functions and facts, in the manner of
torchtitan's `TrainSpec`: its name, how it builds a cell rank's `Replica`, how it lays a
cell's ranks out (`ParallelDims`), which core ranks step an optimizer, and the checks
preflight runs before any process starts. The runtime never switches on a backend's name:
it looks the record up once (`gyre.train.backends.backend`) and asks it.

The `Replica` a backend builds is what the cell's trainer (`gyre.runtime.cell.trainer`)
drives, the same for every backend: the rank's `TorchCell` (flat parameter and gradient
buffers, the two passes of the objective), the tokenizer, the core's optimizer where this
rank owns one, and the weights in the Hugging Face layout (what engines load and policies
save, in `train.params_dtype`; checkpoints keep the optimizer's float32 main weights:
`gyre.train.core_file`).

Torch-free: the run config imports this to validate `train.backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from gyre.train.cell import CoreOptimizer, TorchCell
    from gyre.train.comm import Communicators
    from gyre.train.config import ParallelConfig, ParallelDims, TrainConfig


class Replica(Protocol):
    """A cell rank's part of its cell's model, as every backend builds it."""

    cell: TorchCell
    tokenizer: Any
    optimizer: CoreOptimizer | None  # the core's: its leader's, or each model-parallel rank's
    dims: ParallelDims

    def policy_configs(self) -> tuple[Any, Any]:
        """The leader's transformers config of the policy and its generation config (None
        where the model has none): what a policy directory holds beside the weights."""

    def part(self, shard: int) -> list[tuple[str, torch.Tensor]] | None:
        """This rank's part of the HF-layout weights engines load (collective over the cell;
        `shard`: the rank's position in it): what the rank itself sends in a publication
        (`gyre.runtime.cell.publication`), None where it sends nothing."""

    def main_named(self) -> list[tuple[str, torch.Tensor]] | None:
        """The HF-layout weights a checkpoint keeps, on the leader (collective over the cell;
        None elsewhere): the core's float32 main weights under mixed precision."""

    def hf_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        """A flat buffer (parameters or gradients) in the HF model's flat order, on the
        leader (collective over the cell); None elsewhere."""

    def optimizer_state(self) -> dict[str, Any] | None:
        """The core's AdamW state dict, moments in the HF model's flat order, on the leader
        (collective over a model-parallel core); None without an optimizer."""

    def save(self, folder: Path, version: int, shard: int) -> int:
        """This rank's part of a checkpoint into directory `folder`; bytes written."""

    def restore(self, folder: Path) -> int:
        """Load checkpoint directory `folder` into this rank's replica; returns its version."""


class BuildReplica(Protocol):
    """A backend's builder of a cell rank's replica."""

    def __call__(
        self, model: str, train: TrainConfig, dims: ParallelDims, *, core: bool, device: str,
        comms: Communicators | None = None, host: str = "127.0.0.1",
    ) -> Replica:  # fmt: skip
        """`model` (a model spec) on `device`, laid out by `dims`; `core`: this rank steps
        an optimizer (`TrainBackend.owns_optimizer`); `comms` and `host` (the rank's
        address) for a backend with a process-group world of its own."""


def nothing_to_check() -> None:
    """A backend whose packages Gyre always installs."""


@dataclass(frozen=True, slots=True)
class TrainBackend:
    """One training backend: what the runtime and preflight ask of `train.backend`."""

    name: str
    """Its `train.backend` value."""
    build: BuildReplica
    """A cell rank's replica (see `BuildReplica`)."""
    dims: Callable[[ParallelConfig, int], ParallelDims]
    """The cell's parallel sizes from `train.parallel` over `topology.ranks_per_cell` ranks;
    a ConfigError (its message starting `parallel:`) where the backend cannot lay them out."""
    every_core_rank_steps: bool
    """Whether every model-parallel rank of the core's first data-parallel replica steps an
    optimizer on its own shard rather than only the core's leader, whose step the cell then
    receives."""
    check_installed: Callable[[], None] = nothing_to_check
    """Refuse (ConfigError) a backend this machine cannot run, before any process starts."""
    check_model: Callable[[Mapping[str, Any], ParallelDims], None] | None = None
    """Refuse (ConfigError) a model, by its Hugging Face config, that the backend cannot lay
    out over `dims`; None: it trains any model Gyre loads."""

    def owns_optimizer(self, shard: int, dims: ParallelDims) -> bool:
        """Whether the core cell's rank `shard` steps an optimizer (a cell's other
        data-parallel replicas receive the weights it steps)."""
        return shard == 0 or (self.every_core_rank_steps and dims.place(shard).data == 0)
