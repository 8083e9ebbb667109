"""What one task of Gyre's heterogeneous job learns from Slurm, and what it owes the script.

Inside a heterogeneous step Slurm sets no `SLURM_HET_JOB_*` variables per task; a task finds
its component from its global rank `SLURM_PROCID` and the per-component task counts
`SLURM_NTASKS_HET_GROUP_<n>` (components are laid out in order). The batch script relies on
two things from the run (docs/slurm.md):

* on SIGUSR1 the coordinator (world rank 0) checkpoints, every rank exits, and rank 0 exits
  with `EXIT_CHECKPOINTED` (75, EX_TEMPFAIL); the script then requeues the job;
* a requeued job runs the same command with the same run directory; `restart_count()` > 0
  tells the run it is a restart (the run directory's checkpoint is the source of truth).

    groups = het_group_sizes(os.environ)       # [1, 1, 1, 1, 1]
    locate(int(os.environ["SLURM_PROCID"]), groups)   # (3, 0): het group 3, rank 0 in it
    Layout(topology).component_at(3, 0)               # what it runs (gyre.runtime.shared.layout)
"""

from __future__ import annotations

from collections.abc import Mapping

from gyre.errors import ConfigError
from gyre.runtime.shared.checkpoint import EXIT_CHECKPOINTED

__all__ = ["EXIT_CHECKPOINTED", "het_group_sizes", "locate", "restart_count"]


def het_group_sizes(env: Mapping[str, str]) -> list[int] | None:
    """Tasks per het component, from `SLURM_NTASKS_HET_GROUP_<n>`; None outside a het job."""
    sizes: list[int] = []
    while f"SLURM_NTASKS_HET_GROUP_{len(sizes)}" in env:
        sizes.append(int(env[f"SLURM_NTASKS_HET_GROUP_{len(sizes)}"]))
    return sizes or None


def locate(procid: int, sizes: list[int]) -> tuple[int, int]:
    """(het group, rank within it) of global task `procid` when groups hold `sizes` tasks."""
    if procid < 0:
        raise ConfigError(f"SLURM_PROCID: {procid}; allowed: >= 0")
    start = 0
    for group, size in enumerate(sizes):
        if procid < start + size:
            return group, procid - start
        start += size
    raise ConfigError(f"SLURM_PROCID: {procid}; allowed: below the step's {start} tasks")


def restart_count(env: Mapping[str, str]) -> int:
    """How many times Slurm requeued this job (`SLURM_RESTART_COUNT`, 0 on the first run)."""
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)
