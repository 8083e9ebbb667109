"""Check a job spec against the cluster's partitions before anything is submitted.

`query_cluster()` reads the partitions and their nodes from `scontrol` / `sinfo` (one call
each, with a timeout); `validate(spec, cluster)` is pure and raises `ConfigError` naming the
component, what it asks for and what the partition offers: a missing partition, more nodes
than a partition has (components of a heterogeneous job sit on different nodes), more CPUs
or GPUs per node than its nodes have, a time limit above the partition's.

    validate(job_spec(load_launch(path)), query_cluster())
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field

from gyre.errors import ConfigError
from gyre.launch.config import time_minutes
from gyre.launch.spec import JobSpec, Request


@dataclass(kw_only=True, slots=True)
class Partition:
    """What one partition offers."""

    name: str
    nodes: int
    """Nodes in the partition."""
    max_nodes: int | None = None
    """Most nodes one job (component) may use; None: unlimited."""
    max_time_min: int | None = None
    """MaxTime in minutes; None: unlimited."""
    cpus_per_node: int = 1
    """CPUs of its largest node."""
    gpus_per_node: int = 0
    """GPUs of its best-equipped node."""
    default: bool = False
    """The partition jobs land in when they name none."""
    up: bool = True


@dataclass(kw_only=True, slots=True)
class Cluster:
    """The partitions of a Slurm cluster by name."""

    partitions: dict[str, Partition] = field(default_factory=dict)

    def resolve(self, name: str | None) -> Partition | None:
        if name is None:
            return next((p for p in self.partitions.values() if p.default), None)
        return self.partitions.get(name)


def validate(spec: JobSpec, cluster: Cluster) -> None:
    """`ConfigError` when the cluster cannot run `spec` (see the module docstring)."""
    used: dict[str, int] = defaultdict(int)
    for c in spec.components:
        part = _partition_for(c, cluster)
        used[part.name] += c.nodes
        _check_component(c, part)
    for name, nodes in used.items():
        part = cluster.partitions[name]
        if nodes > part.nodes:
            wanted = ", ".join(
                f"{c.label} {c.nodes}"
                for c in spec.components
                if _partition_for(c, cluster).name == name
            )
            raise ConfigError(
                f"slurm: the job asks for {nodes} nodes in partition {name!r} ({wanted}), "
                f"which has {part.nodes}; allowed: at most {part.nodes} nodes there (fewer or "
                "smaller cells, or another partition)"
            )
    limit = spec.launch.slurm.time_limit
    minutes = time_minutes(limit)
    for name in used:
        part = cluster.partitions[name]
        if part.max_time_min is not None and minutes is not None and minutes > part.max_time_min:
            raise ConfigError(
                f"slurm.time_limit: {limit!r} exceeds the MaxTime of partition {name!r} "
                f"({part.max_time_min} minutes); allowed: at most {part.max_time_min} minutes"
            )


def _partition_for(c: Request, cluster: Cluster) -> Partition:
    part = cluster.resolve(c.partition)
    if part is None:
        known = ", ".join(sorted(cluster.partitions)) or "none"
        what = repr(c.partition) if c.partition else "the default partition"
        raise ConfigError(
            f"slurm: {c.label} asks for {what}, which this cluster does not have; allowed "
            f"partitions: {known}"
        )
    return part


def _check_component(c: Request, part: Partition) -> None:
    if not part.up:
        raise ConfigError(f"slurm: partition {part.name!r} ({c.label}) is not up")
    if part.max_nodes is not None and c.nodes > part.max_nodes:
        raise ConfigError(
            f"slurm: {c.label} asks for {c.nodes} nodes; partition {part.name!r} allows "
            f"{part.max_nodes} per job (MaxNodes)"
        )
    cpus = c.ntasks_per_node * c.cpus_per_task
    if cpus > part.cpus_per_node:
        raise ConfigError(
            f"slurm: {c.label} needs {cpus} CPUs per node ({c.ntasks_per_node} tasks x "
            f"{c.cpus_per_task} cpus_per_task); nodes of partition {part.name!r} have "
            f"{part.cpus_per_node}"
        )
    if c.gpus_per_node > part.gpus_per_node:
        raise ConfigError(
            f"slurm: {c.label} asks for {c.gpus_per_node} GPUs per node; nodes of partition "
            f"{part.name!r} have {part.gpus_per_node}"
        )


def query_cluster(timeout_s: float = 30.0) -> Cluster:
    """The current cluster's partitions (`scontrol show partition` / `show node`)."""
    text = _run(["scontrol", "show", "partition", "--oneliner"], timeout_s)
    nodes = _run(["scontrol", "show", "node", "--oneliner"], timeout_s)
    return parse_cluster(text, nodes)


def parse_cluster(partitions_text: str, nodes_text: str) -> Cluster:
    """Build a `Cluster` from `scontrol show partition -o` and `scontrol show node -o`.

    (`sinfo` hides powered-down cloud nodes, which still count for a job.)
    """
    cpus: dict[str, int] = defaultdict(int)
    gpus: dict[str, int] = defaultdict(int)
    for line in nodes_text.splitlines():
        f = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" not in f:
            continue
        for part in f.get("Partitions", "").split(","):
            cpus[part] = max(cpus[part], int(f.get("CPUTot", "1")))
            gpus[part] = max(gpus[part], _gpus(f.get("Gres", "")))
    cluster = Cluster()
    for line in partitions_text.splitlines():
        f = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" not in f:
            continue
        name = f["PartitionName"]
        cluster.partitions[name] = Partition(
            name=name,
            nodes=int(f.get("TotalNodes", "0")),
            max_nodes=None if f.get("MaxNodes", "UNLIMITED") == "UNLIMITED" else int(f["MaxNodes"]),
            max_time_min=time_minutes(f.get("MaxTime", "UNLIMITED")),
            cpus_per_node=cpus.get(name, 1),
            gpus_per_node=gpus.get(name, 0),
            default=f.get("Default") == "YES",
            up=f.get("State", "UP") == "UP",
        )
    return cluster


def _gpus(gres: str) -> int:
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item)
        if m:
            total += int(m.group(1))
    return total


def _run(cmd: list[str], timeout_s: float) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise ConfigError(f"{cmd[0]} not found: is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{' '.join(cmd)} did not answer within {timeout_s:.0f}s") from None
    if out.returncode:
        raise ConfigError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
    return out.stdout
