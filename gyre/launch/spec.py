"""The heterogeneous job a run config asks for: one Slurm component per Gyre component.

Component 0 is the coordinator, component 1 the proxy / harness node, components 2..K+1 the
cells (each `slurm.nodes_per_cell` nodes holding the cell's R ranks), and, when the topology
has standalone engines, one last component holding the standalone rollout pool. Task order
inside `srun --het-group=0-N` is component order, so world ranks come out exactly as
`gyre.runtime.shared.layout` expects (coordinator 0, proxy 1, cells, standalone engines).

    launch = load_launch("templates/cluster/paper-32.yaml")
    spec = job_spec(launch)          # ConfigError if the cell layout does not fit the nodes
    spec.total_nodes, [c.ntasks for c in spec.components]
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gyre.config import load
from gyre.errors import ConfigError
from gyre.launch.config import SlurmConfig, TopologyConfig, check_log_dir, time_minutes
from gyre.runtime.preflight import Where, preflight
from gyre.runtime.shared.layout import Layout, RankGroup
from gyre.runtime.shared.placement import check_gpus


@dataclass(kw_only=True, slots=True)
class Launch:
    """What the launcher needs from a run config file."""

    path: Path
    """The run config file (passed to every task)."""
    name: str
    """Run name (`name:`)."""
    runs_dir: str
    """Where run directories are created (`runs_dir:`)."""
    topology: TopologyConfig
    """Cells, ranks per cell and standalone engines."""
    slurm: SlurmConfig
    """The `slurm:` section."""
    harness_concurrency: int = 0
    """Harnesses that may run at once on the proxy node (every rollout engine full)."""
    suite: str | list[str] = "builtin"
    """The task suite (`harness.suite`): shipped name, directory, YAML or data file, or a list."""
    warnings: tuple[str, ...] = ()
    """The run config's own warnings (`RunConfig.warnings`)."""
    backends: str = ""
    """The cells' training and engine backends and parallel sizes, in words (`gyre render`)."""
    engine_gpus: int = 0
    """GPUs one engine serves on (`engine.tensor_parallel` x `engine.nodes` for SGLang, 1
    for a CUDA embedded engine, 0 on the CPU)."""
    engines_per_cell: int = 1
    """A cell's engines (`RunConfig.engines_per_cell`): with `engine_gpus` what a cell serves
    rollout on; its other GPUs idle while it serves."""


@dataclass(kw_only=True, slots=True)
class Request:
    """What the job asks Slurm for one group of the world's layout (`gyre.runtime.shared.layout.
    RankGroup`): one `#SBATCH hetjob` block."""

    group: RankGroup
    """The world ranks it holds: coordinator, proxy, one cell or the standalone pool."""
    nodes: int
    """Nodes of this component."""
    cpus_per_task: int
    """CPUs per task."""
    gpus_per_node: int = 0
    """GPUs per node (0: none requested)."""
    partition: str | None = None
    """Partition (None: the cluster's default)."""
    mem: str | None = None
    """Memory per node (None: the partition's default)."""
    constraint: str | None = None
    """Node feature constraint."""

    @property
    def role(self) -> str:
        return self.group.kind

    @property
    def index(self) -> int:
        return self.group.index

    @property
    def ntasks(self) -> int:
        """Tasks (MPI ranks) of this component."""
        return self.group.size

    @property
    def label(self) -> str:
        return f"cell {self.index}" if self.role == "cell" else self.role

    @property
    def ntasks_per_node(self) -> int:
        return self.ntasks // self.nodes


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """The whole heterogeneous job: components in world-rank order plus the job options."""

    launch: Launch
    components: list[Request] = field(default_factory=list)

    @property
    def total_nodes(self) -> int:
        return sum(c.nodes for c in self.components)

    @property
    def world_size(self) -> int:
        return sum(c.ntasks for c in self.components)

    @property
    def gpus(self) -> int:
        return sum(c.nodes * c.gpus_per_node for c in self.components)

    def footprint(self) -> list[str]:
        """What the job takes (one line), then a line per warning, for `gyre render`."""
        limit = self.launch.slurm.time_limit
        minutes = time_minutes(limit)
        if minutes is None:
            hours = "unlimited GPU-hours and node-hours"
        else:  # node-hours: exclusive coordinator and proxy nodes are billed whole too
            hours = (f"{self.gpus * minutes / 60:g} GPU-hours and "
                     f"{self.total_nodes * minutes / 60:g} node-hours")  # fmt: skip
        lines = [f"{self.total_nodes} nodes, {self.gpus} GPUs, {self.world_size} ranks; "
                 f"{hours} at the time limit {limit}"]  # fmt: skip
        if self.launch.backends:
            lines.append(f"cells: {self.launch.backends}")
        proxy = next(c for c in self.components if c.role == "proxy")
        if self.launch.harness_concurrency > proxy.cpus_per_task:
            lines.append(
                f"warning: up to {self.launch.harness_concurrency} harnesses run at once on "
                f"the proxy node, which has {proxy.cpus_per_task} CPUs "
                "(slurm.proxy.cpus_per_task); harness tools will queue for CPU"
            )
        lines += self._idle_during_rollout()
        return lines + [f"warning: {w}" for w in self.launch.warnings]

    def _idle_during_rollout(self) -> list[str]:
        """A warning where a cell has more GPUs than its engines serve on: the rest wait out
        every rollout phase."""
        e, one = self.launch.engines_per_cell, self.launch.engine_gpus
        cells = [c for c in self.components if c.role == "cell" and c.gpus_per_node]
        held = {c.nodes * c.gpus_per_node for c in cells}
        if not one or not held or max(held) <= e * one:
            return []
        gpus, idle = max(held), max(held) - e * one
        engines = f"{e} engines" if e > 1 else "one engine"
        return [
            f"warning: each cell's {gpus} GPUs serve rollout from {engines} on {one} GPUs each "
            f"(engine.tensor_parallel x engine.nodes): {idle} ({100 * idle // gpus}%) idle "
            "while it serves (engine.per_cell auto fills a colocated cell)"
        ]

    @property
    def het_groups(self) -> str:
        """The `srun --het-group=` value covering every component."""
        return f"0-{len(self.components) - 1}"


def load_launch(
    path: str | Path, overrides: Sequence[str] = (), where: Where = Where.ANYWHERE, *,
    run_dir: Path | None = None,
) -> Launch:  # fmt: skip
    """Read and fully validate a run config; return what the launcher needs.

    The whole file is validated as a `gyre.runtime.shared.config.RunConfig` and passes the run's
    preflight (`gyre.runtime.preflight`: harness, suite and tasks, the model against both
    backends, backends against the GPUs each node requests, trackers, the log folder, the run
    directory `run_dir` when known; `where` says how much of the cluster is visible), so a bad
    config is found before submission. With `KEY.PATH=VALUE`
    overrides, the merged config is written to
    `<runs_dir>/configs/<name>-<hash>.yaml` (named by its content) and `Launch.path` points
    there, so every task of the job reads exactly the config validated here.
    """
    from gyre.runtime.shared.config import parse_run_config

    p = Path(path)
    run, data = parse_run_config(p, overrides)
    slurm = load(SlurmConfig, run.slurm, path="run.slurm")
    # the job's GPUs per node against the backends, and (login node) its log folder
    check_gpus(run, slurm.gpus_per_node, slurm.nodes_per_cell, slurm.standalone_nodes)
    if where is Where.CLUSTER:
        check_log_dir(slurm)
    notes = preflight(run, where, run_dir=run_dir)
    if overrides:
        p = _write_merged(data, p, Path(run.runs_dir) / "configs", run.name)
    engines = run.topology.cells + run.topology.standalone_engines
    return Launch(path=p, name=run.name, runs_dir=run.runs_dir, topology=run.topology, slurm=slurm,
                  harness_concurrency=run.schedule.concurrency_per_cell * engines,
                  suite=run.harness.suite, warnings=tuple(notes),
                  backends=backends(run), engine_gpus=engine_gpus(run),
                  engines_per_cell=run.engines_per_cell)  # fmt: skip


def engine_gpus(run: Any) -> int:
    """GPUs one engine of `run` serves on (0: it serves on the CPU)."""
    if run.engine.backend == "sglang":
        return int(run.engine.tensor_parallel * run.engine.nodes)
    return 1 if run.engine.device == "cuda" else 0


def backends(run: Any) -> str:
    """A run's cell backends in words: `train megatron (tensor 2 x pipeline 1 x data 1 per
    cell), engine sglang (TP 2, 1 per cell)`."""
    d = run.dims
    return (f"train {run.train.backend} (tensor {d.tensor} x pipeline {d.pipeline} x data "
            f"{d.data} per cell), engine {run.engine.backend} (TP {run.engine.tensor_parallel}"
            + (f" x {run.engine.nodes} nodes" if run.engine.nodes > 1 else "")
            + f", {run.engines_per_cell} per cell)")  # fmt: skip


def _write_merged(data: dict[str, Any], source: Path, folder: Path, name: str) -> Path:
    """The merged config as a YAML file named by its content (rewritten only if new)."""
    text = f"# {source} with command-line overrides\n" + yaml.safe_dump(data, sort_keys=False)
    out = folder / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}.yaml"
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return out


def job_spec(launch: Launch) -> JobSpec:
    """The components of the job, one per group of the world's `Layout`; `ConfigError`
    when the layout does not fit the nodes."""
    s, t = launch.slurm, launch.topology
    _check_divides("slurm.nodes_per_cell", s.nodes_per_cell, t.ranks_per_cell,
                   "topology.ranks_per_cell")  # fmt: skip
    _check_standalone(s, t)
    spec = JobSpec(launch=launch)
    for g in Layout(t).groups:
        if g.kind in ("coordinator", "proxy"):
            node = s.coordinator if g.kind == "coordinator" else s.proxy
            spec.components.append(
                Request(
                    group=g,
                    nodes=1,
                    cpus_per_task=node.cpus_per_task,
                    gpus_per_node=node.gpus,
                    partition=node.partition or s.partition,
                    mem=node.mem,
                    constraint=node.constraint,
                )
            )
            continue
        nodes = s.nodes_per_cell if g.kind == "cell" else s.standalone_nodes
        spec.components.append(
            Request(
                group=g,
                nodes=nodes,
                cpus_per_task=s.cpus_per_task,
                gpus_per_node=s.gpus_per_node,
                partition=s.partition,
                mem=s.mem,
                constraint=s.constraint,
            )
        )
    return spec


def _check_divides(nodes_key: str, nodes: int, ranks: int, ranks_key: str) -> None:
    if ranks % nodes:
        raise ConfigError(
            f"{nodes_key}: {nodes} does not divide {ranks_key} ({ranks}): a cell's ranks must "
            f"spread evenly over its nodes; allowed: a divisor of {ranks} (e.g. "
            f"{', '.join(str(d) for d in _divisors(ranks))})"
        )


def _check_standalone(s: SlurmConfig, t: TopologyConfig) -> None:
    """The engine pool's nodes (`slurm.standalone_nodes`) hold its standalone and judge
    engines, spread evenly."""
    engines = (f"topology.standalone_engines + topology.judge_engines ({t.standalone_engines} "
               f"+ {t.judge_engines})")  # fmt: skip
    if t.pool and not s.standalone_nodes:
        raise ConfigError(
            f"slurm.standalone_nodes: 0 but {engines} is {t.pool}; allowed: 1..{t.pool} nodes "
            "for the engine pool"
        )
    if s.standalone_nodes and not t.pool:
        raise ConfigError(
            f"slurm.standalone_nodes: {s.standalone_nodes} but {engines} is 0; allowed: 0 "
            "nodes, or add standalone or judge engines"
        )
    if t.pool:
        _check_divides("slurm.standalone_nodes", s.standalone_nodes, t.pool, engines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:8]
