"""Training backends by `train.backend`: the one registry the runtime builds from.

Each backend is a `TrainBackend` record (`protocol`) defined in a module of its own:

* `torch`    — every rank of a cell holds the whole model (data parallel in the cell);
* `megatron` — megatron-core, the model sharded over a cell's ranks (tensor x pipeline x
  data).

The run config validates `train.backend` here and every question that depends on it is
asked of the record, never of the name:

    trainer = backend(cfg.train.backend)        # ConfigError naming the allowed names
    dims = trainer.dims(cfg.train.parallel, cfg.topology.ranks_per_cell)
    replica = trainer.build(cfg.model, cfg.train, dims, core=trainer.owns_optimizer(0, dims),
                            device="cpu")

Adding a backend is one new module defining its record and one entry in `BACKENDS`.
Importing this package is cheap: the backends import torch and megatron-core only when a
replica is built.
"""

from __future__ import annotations

from gyre.errors import ConfigError
from gyre.train.backends.megatron import MEGATRON
from gyre.train.backends.protocol import BuildReplica, Replica, TrainBackend
from gyre.train.backends.torch import TORCH

__all__ = ["BACKENDS", "BuildReplica", "Replica", "TrainBackend", "backend"]

BACKENDS: dict[str, TrainBackend] = {b.name: b for b in (TORCH, MEGATRON)}
"""Training backends by `train.backend`."""


def backend(name: str) -> TrainBackend:
    """The training backend called `name`; a ConfigError naming the allowed ones."""
    found = BACKENDS.get(name)
    if found is None:
        allowed = ", ".join(repr(n) for n in BACKENDS)
        raise ConfigError(f"backend: {name!r} is not allowed; choose one of {allowed}")
    return found
