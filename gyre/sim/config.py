"""Configuration of a simulation: cluster + scheduler, per-policy knobs, workload, costs.

A YAML template (templates/sim/*.yaml) maps onto `SimConfig`. A template may start with
`base: other.yaml` (relative to itself); its keys are merged over the base's, recursively,
which is how the Table 1 ablations reuse the NL2RepoBench template:

    cfg = load_sim_config("templates/sim/nl2repo.yaml")
    sched, policy = cfg.scheduler_for("elastic")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config import load, read_mapping
from gyre.errors import ConfigError
from gyre.schedule.config import POLICIES, Config, PolicyConfig
from gyre.schedule.devices import CostConfig
from gyre.schedule.plan import plan_for
from gyre.sim.workload import WorkloadConfig


@dataclass(kw_only=True, slots=True)
class PolicySpec:
    """Table 1 knobs of one policy; unset values come from `scheduler` / `staleness`."""

    phi: float | None = None
    """φ; default: from `staleness` by `gyre plan` (else the scheduler's φ)."""
    mu: int | None = None
    """μ; default: from `staleness` by `gyre plan` (else the scheduler's μ)."""
    streaming: bool = True
    """Stream groups into a batch as they become ready."""
    train_cells: int = 1
    """Async: cells fixed in training."""
    nodes: int | None = None
    """Override: nodes in cells (the rest of the budget may be standalone)."""
    cells: int | None = None
    """Override: number of cells (cell granularity)."""
    standalone_nodes: int | None = None
    """Override: standalone rollout nodes."""
    concurrency_per_cell: int | None = None
    """Override: concurrency of one cell-sized engine (scale it with the cell size)."""


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulation template."""

    steps: int = 48
    """S: training steps to simulate."""
    seed: int = 0
    """Seed of the workload generator (same seed, same result)."""
    staleness: float | None = None
    """Target E[d]; policies without explicit φ/μ get them from `gyre plan`."""
    policy: str = "all"
    """Policy run by default: elastic, async, colocate or all."""
    scheduler: Config = field(default_factory=Config)
    """Cells, N, B, default φ/μ, supply and join thresholds."""
    policies: dict[str, PolicySpec] = field(default_factory=dict)
    """Per-policy knobs, keyed by elastic / async / colocate."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Execution duration, timeout, evaluation and token model."""
    costs: CostConfig = field(default_factory=CostConfig)
    """Switch, publication, update and training throughput costs."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps: {self.steps}; allowed >= 1")
        check_policy(self.policy, allow_all=True, key="policy")
        for name in self.policies:
            check_policy(name, allow_all=False, key=f"policies.{name}")

    def scheduler_for(self, name: str) -> tuple[Config, PolicyConfig]:
        """The scheduler config and policy config that policy `name` runs with."""
        check_policy(name, allow_all=False, key="policy")
        spec = self.policies.get(name, PolicySpec())
        phi, mu = self.scheduler.phi, self.scheduler.mu
        if self.staleness is not None:
            planned = plan_for(name, self.staleness)
            phi, mu = planned.phi, planned.mu
        changes: dict[str, Any] = {
            "phi": spec.phi if spec.phi is not None else phi,
            "mu": spec.mu if spec.mu is not None else mu,
            "window": self.scheduler.window_for(self.costs.pipeline_stages),  # modelled cells'
        }
        for key in ("nodes", "cells", "standalone_nodes", "concurrency_per_cell"):
            if getattr(spec, key) is not None:
                changes[key] = getattr(spec, key)
        try:
            sched = dataclasses.replace(self.scheduler, **changes)
        except ConfigError as e:
            raise ConfigError(f"policies.{name}.{e}") from None
        policy = PolicyConfig(name=name, streaming=spec.streaming, train_cells=spec.train_cells)  # type: ignore[arg-type]
        return sched, policy


def check_policy(name: str, *, allow_all: bool, key: str) -> None:
    allowed = (*POLICIES, "all") if allow_all else POLICIES
    if name not in allowed:
        raise ConfigError(f"{key}: {name!r} is unknown; allowed: {', '.join(allowed)}")


RUN_SECTIONS = ("topology", "schedule", "harness", "engine", "proxy", "train")
"""Sections of a run config (`gyre run`) that no sim template has."""


def read_template(path: str | Path) -> dict[str, Any]:
    """Read a YAML template, resolving `base:` chains; a run config is a ConfigError that
    names the sim templates (it has no workload to simulate: its harnesses' durations are
    what a run measures, and `gyre sim --replay RUN_DIR` fits them from a recorded run)."""
    p = Path(path)
    data = read_mapping(p)
    if any(key in data for key in RUN_SECTIONS):
        raise ConfigError(
            f"config: {p} is a run config (gyre run); gyre sim takes a sim config such as "
            "templates/sim/nl2repo.yaml, or --replay RUN_DIR of a run made with it"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(read_template(p.parent / str(base)), data)


def load_sim_config(path: str | Path) -> SimConfig:
    """Load and validate a simulation template."""
    return load(SimConfig, read_template(path), path=Path(path).stem)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
