"""Placement policies: Elastic, Async and Colocate as small objects over one machine.

A policy only answers *which cells may switch, in which units, and whether batches stream*;
the counters, dispatch, waterlevel and supply checks, rerouting and training live once in
`gyre.schedule.machine.Scheduler`. A *switch unit* is a tuple of cells that changes role
together; units leave rollout strictly in order, so the training cells always form a prefix
(core first) and the prefix communicators of the runtime apply.

* Elastic: every cell is its own unit (fine granularity).
* Colocate: all cells form one unit (the pool switches together, once the outstanding
  executions fit on the standalone pool, i.e. once they finished when there is none).
* Async: no units; the first `train_cells` cells are fixed in training, the rest in rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.errors import ConfigError
from gyre.schedule.config import Config, PolicyConfig


@dataclass(frozen=True, slots=True)
class Policy:
    """What distinguishes one placement policy from another."""

    name: str
    streaming: bool
    units: tuple[tuple[int, ...], ...]
    """Switch units in leaving order; unit 0 holds the core. Empty for fixed pools."""
    fixed_train: tuple[int, ...] = ()
    """Cells that train for the whole run (Async)."""

    @property
    def switches(self) -> bool:
        return bool(self.units)


def elastic(config: Config, streaming: bool = True) -> Policy:
    """Cells leave rollout one by one (core first) as the waterlevel falls."""
    units = tuple((k,) for k in range(config.cells))
    return Policy(name="elastic", streaming=streaming, units=units)


def colocate(config: Config, streaming: bool = False) -> Policy:
    """The whole cell pool switches as one unit."""
    return Policy(name="colocate", streaming=streaming, units=(tuple(range(config.cells)),))


def asynchronous(config: Config, train_cells: int, streaming: bool = False) -> Policy:
    """A fixed split: cells 0..train_cells-1 train, the others (and standalone) roll out."""
    if train_cells >= config.cells and config.standalone_nodes == 0:
        raise ConfigError(
            f"train_cells: {train_cells} leaves no rollout engine; allowed 1..{config.cells - 1} "
            "(or add standalone_nodes)"
        )
    if train_cells > config.cells:
        raise ConfigError(f"train_cells: {train_cells}; allowed 1..{config.cells}")
    return Policy(
        name="async", streaming=streaming, units=(), fixed_train=tuple(range(train_cells))
    )


def make_policy(config: Config, policy: PolicyConfig) -> Policy:
    """Build the policy object `policy` names for the cells of `config`."""
    if policy.name == "elastic":
        return elastic(config, policy.streaming)
    if policy.name == "colocate":
        return colocate(config, policy.streaming)
    if policy.name == "async":
        return asynchronous(config, policy.train_cells, policy.streaming)
    raise ConfigError(f"name: {policy.name!r} is unknown; allowed: elastic, async, colocate")
