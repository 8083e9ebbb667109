"""Typed `slurm:` section of a Gyre run config: how the one MPI world maps onto a cluster.

Gyre runs as one heterogeneous Slurm job (docs/slurm.md): component 0 the coordinator,
component 1 the proxy / harness node, then one component per cell (`nodes_per_cell` nodes
sharing the cell's R ranks), then an optional standalone rollout pool. This dataclass holds
everything the rendered sbatch script needs beyond the run's topology (cells, ranks per cell,
standalone engines), which the runtime's `RunConfig` owns (`gyre.runtime.shared.layout.TopologyConfig`;
the runtime keeps the `slurm:` section as data and only the launcher reads it):

    slurm:
      partition: gpu
      time_limit: "2-00:00:00"
      nodes_per_cell: 4
      gpus_per_node: 8
      signal_seconds: 300

Every value is validated in `__post_init__`; a bad one is a `ConfigError` naming the field,
the value and what is allowed. Values are never rewritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gyre.errors import ConfigError
from gyre.runtime.shared.layout import TopologyConfig

__all__ = ["MPI_PLUGINS", "PMI2_ENV", "RESERVED_OPTIONS", "SlurmConfig", "TopologyConfig"]

MPI_PLUGINS = ("pmi2", "pmix")

PMI2_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi"}
"""Exported under `--mpi=pmi2` unless `slurm.env` sets the same name. The pip MPICH speaks
the PMI-1 wire protocol only; Slurm's pmi2 plugin reads each PMI-1 request with one read of
at most 1024 bytes. MPICH's UCX netmod publishes a 4096-byte address card (the UCX address and
whatever heap follows it) in hex segments of up to 1022 characters, so a `put` line whose
segment does not compress is cut: the peers decode a truncated card and MPI_Init fails or
hangs (docs/slurm.md). The OFI netmod's card is one 90-byte line."""

# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; also "infinite"/"unlimited".
_TIME_RE = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2})$")
# Slurm memory: an integer with an optional K/M/G/T suffix ("0" = all memory of the node).
_MEM_RE = re.compile(r"^\d+[KMGT]?$")
# A name Slurm accepts for a partition / account / qos / job name: no spaces, no shell metas.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.+\-]+$")
# Options the renderer writes itself; an extra line must not fight them.
RESERVED_OPTIONS = (
    "--partition",
    "--account",
    "--qos",
    "--time",
    "--nodes",
    "--ntasks",
    "--ntasks-per-node",
    "--cpus-per-task",
    "--gpus-per-node",
    "--mem",
    "--job-name",
    "--output",
    "--error",
    "--signal",
    "--requeue",
    "--no-requeue",
    "--open-mode",
)


@dataclass(kw_only=True, slots=True)
class NodeSpec:
    """Resources of a single-node component (coordinator or proxy / harness node)."""

    partition: str | None = None
    """Partition for this component; default: the job's `partition`."""
    cpus_per_task: int = 1
    """CPUs of the component's single task (the proxy hosts the harness pool: give it many)."""
    gpus: int = 0
    """GPUs on the component's node (the coordinator and proxy need none)."""
    mem: str | None = None
    """Memory of the node (`64G`, `0` = all); default: the partition's default."""
    constraint: str | None = None
    """Slurm `--constraint` feature expression for this component's node."""

    def __post_init__(self) -> None:
        _optional_name("partition", self.partition)
        _at_least("cpus_per_task", self.cpus_per_task, 1)
        _at_least("gpus", self.gpus, 0)
        _mem("mem", self.mem)
        _no_space("constraint", self.constraint)


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    """How the run's heterogeneous job is requested from Slurm and started with `srun`."""

    partition: str | None = None
    """Partition of the cells (and of components without their own); default: the cluster's."""
    account: str | None = None
    """Slurm account charged for the job (`--account`)."""
    qos: str | None = None
    """Quality of service (`--qos`)."""
    time_limit: str = "01:00:00"
    """Wall-clock limit in Slurm's format (`M`, `H:M:S`, `D-H:M:S`, ...)."""
    job_name: str = "gyre"
    """Job name shown by squeue."""
    nodes_per_cell: int = 1
    """Nodes of one cell; the cell's R ranks (`topology.ranks_per_cell`) spread evenly on them."""
    gpus_per_node: int = 0
    """GPUs requested per cell / standalone node (`--gpus-per-node`); 0 on CPU clusters."""
    cpus_per_task: int = 1
    """CPUs per cell rank."""
    mem: str | None = None
    """Memory per cell / standalone node (`0` = all of it); default: the partition's."""
    constraint: str | None = None
    """`--constraint` for cell and standalone nodes."""
    coordinator: NodeSpec = field(default_factory=NodeSpec)
    """Het component 0: the coordinator (scheduler, buffers, HDF5 store)."""
    proxy: NodeSpec = field(default_factory=NodeSpec)
    """Het component 1: the proxy node, which also hosts the harness pool."""
    standalone_nodes: int = 0
    """Nodes of the standalone pool; its engines (`topology.standalone_engines`) spread evenly."""
    signal_seconds: int = 300
    """Send SIGUSR1 this many seconds before the time limit so the run checkpoints; 0 = off."""
    requeue: bool = True
    """Let Slurm requeue the job after preemption or a checkpoint-and-exit (`--requeue`)."""
    mpi: Literal["pmi2", "pmix"] = "pmi2"
    """`srun --mpi=` plugin: pmi2 (MPICH; reliable for het steps on Slurm 22.05) or pmix."""
    exclusive: bool = False
    """Request whole nodes (`--exclusive`) for every component."""
    log_dir: str = "."
    """Folder (relative to the submission directory or absolute) for the job's stdout/stderr."""
    python: str = "python3"
    """Python interpreter every task runs (after `setup`)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before the step (module load, venv activation)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported to every task (over the `mpi` plugin's, `PMI2_ENV`)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options for the whole job, e.g. `--mail-type=END` (leading `--`)."""
    srun_args: list[str] = field(default_factory=list)
    """Extra arguments of the one `srun` step, e.g. `--cpu-bind=none`."""

    def __post_init__(self) -> None:
        for name in ("partition", "account", "qos"):
            _optional_name(name, getattr(self, name))
        if not _NAME_RE.match(self.job_name):
            raise ConfigError(
                f"job_name: {self.job_name!r}; allowed: letters, digits and _.+- (no spaces)"
            )
        _time(self.time_limit)
        _at_least("nodes_per_cell", self.nodes_per_cell, 1)
        _at_least("gpus_per_node", self.gpus_per_node, 0)
        _at_least("cpus_per_task", self.cpus_per_task, 1)
        _mem("mem", self.mem)
        _no_space("constraint", self.constraint)
        _at_least("standalone_nodes", self.standalone_nodes, 0)
        _at_least("signal_seconds", self.signal_seconds, 0)
        if self.signal_seconds > 65535:
            raise ConfigError(
                f"signal_seconds: {self.signal_seconds}; allowed 0..65535 (Slurm's limit)"
            )
        if self.mpi not in MPI_PLUGINS:
            raise ConfigError(f"mpi: {self.mpi!r}; allowed one of {', '.join(MPI_PLUGINS)}")
        if not self.log_dir or "%" in self.log_dir:
            raise ConfigError(
                f"log_dir: {self.log_dir!r}; allowed: a non-empty path without '%' patterns"
            )
        if not self.python.strip():
            raise ConfigError("python: empty; allowed: an interpreter name or path")
        _extra_sbatch(self.extra_sbatch)
        for key in self.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ConfigError(f"env: {key!r} is not a shell variable name")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name}: {value}; allowed an integer >= {low}")


def _optional_name(name: str, value: str | None) -> None:
    if value is not None and not _NAME_RE.match(value):
        raise ConfigError(
            f"{name}: {value!r}; allowed: a Slurm name (letters, digits, _.+-) or unset"
        )


def _time(value: str) -> None:
    if value.lower() in ("infinite", "unlimited"):
        return
    if not _TIME_RE.match(value):
        raise ConfigError(
            f"time_limit: {value!r}; allowed Slurm time formats M, M:S, H:M:S, D-H, D-H:M, "
            "D-H:M:S or 'infinite'"
        )


def _mem(name: str, value: str | None) -> None:
    if value is not None and not _MEM_RE.match(value):
        raise ConfigError(f"{name}: {value!r}; allowed an integer with optional K/M/G/T suffix")


def _no_space(name: str, value: str | None) -> None:
    if value is not None and (not value or any(c.isspace() for c in value)):
        raise ConfigError(f"{name}: {value!r}; allowed a non-empty value without spaces")


def _extra_sbatch(lines: list[str]) -> None:
    for i, line in enumerate(lines):
        if not line.startswith("--") or "\n" in line:
            raise ConfigError(
                f"extra_sbatch[{i}]: {line!r}; allowed a single long option such as "
                "'--mail-type=END' (without '#SBATCH')"
            )
        option = line.split("=", 1)[0].split(" ", 1)[0]
        if option in RESERVED_OPTIONS or option == "--hetjob":
            raise ConfigError(
                f"extra_sbatch[{i}]: {option} is set by Gyre from the config; allowed: any "
                f"option except {', '.join(RESERVED_OPTIONS)}, --hetjob"
            )


def check_log_dir(slurm: SlurmConfig) -> None:
    """On the login node (`gyre render --check`, `gyre submit`): `log_dir`, relative to the
    submission directory (this one), is a folder gyre can write. Slurm does not create it: a
    job whose output folder is missing fails at once, without a log."""
    from argparse import ArgumentTypeError

    from gyre.cliargs import directory_to_make

    if not Path(slurm.log_dir).is_dir():
        raise ConfigError(
            f"slurm.log_dir: {slurm.log_dir!r} is not a directory (from {Path.cwd()}); "
            "allowed: an existing folder (Slurm does not create it), e.g. slurm.log_dir=."
        )
    try:
        directory_to_make(slurm.log_dir)
    except ArgumentTypeError as e:
        raise ConfigError(f"slurm.log_dir: {e}") from None


def time_minutes(value: str) -> int | None:
    """Slurm time string -> whole minutes (rounded up); None for infinite / unlimited."""
    if value.lower() in ("infinite", "unlimited"):
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, s = [*parts, 0, 0, 0][:3]
        return int(days) * 1440 + h * 60 + m + (1 if s else 0)
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0] + (1 if parts[1] else 0)
    return parts[0] * 60 + parts[1] + (1 if parts[2] else 0)
