"""Which device every rank of one node uses and which GPUs its engine serves on (pure).

What: `plan_node` takes the node's GPU count, the component of each local rank
(`gyre.runtime.shared.layout.Component`, indexed by local rank), the engines' `tensor_parallel` and a
mode, and returns every local rank's device (`cuda:N` or `cpu`) and, for each rank that hosts
an engine (a cell leader, shard 0, or a standalone engine), the engine's `base_gpu_id` and GPU
list. `local_rank` and `node_ranks` find a rank's place on its node from the launcher.

Why: without it every replica lands on `cuda:0` beside the engine (issue 42). Two modes:

* `disjoint` — a node's GPUs are dealt out in blocks, one per cell (its trainer ranks on this
  node, then its engine's `tensor_parallel` GPUs when the leader is here) and one per
  standalone engine; nobody shares a GPU;
* `colocated` — a cell's trainer ranks share the GPUs of the cell's engine (block size
  max(trainer ranks, tensor_parallel)); a trainer rank whose GPU the engine also uses is
  marked `offload`: its state leaves the device on every switch to rollout and comes back on
  the switch to train (`gyre.runtime.cell.residency.TrainerResidency`).

Trainer ranks never share a GPU with each other in either mode (two cells may train at
once). Coordinator and proxy ranks run on the CPU; so does everything on a node with 0 GPUs.
Too few GPUs is a `ConfigError` naming the counts.

How:

    me = local_rank(os.environ, world)                       # at rank start
    on_node = [components[r] for r in node_ranks(world, os.environ)]  # index = local rank
    plan = plan_node(gpus, on_node, tensor_parallel=2, mode="colocated")
    plan[me].device, plan[me].engine, plan[me].offload       # "cuda:1", EngineGpus(...), True

No torch, no CUDA calls; mpi4py is imported only when a communicator has to be split.

The preflight's checks of this domain (`gyre.runtime.preflight`) plan as the ranks will:
`check_gpus` every node of a cluster job on `slurm.gpus_per_node` GPUs (the launch layer
calls it, which owns the Slurm section); `check_ranks_here` and `check_devices_here`, as
`Check` functions (`gyre.runtime.shared.checks`), what `gyre run` starts on this machine (the
latter asks torch how many GPUs it has, at call time).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gyre.errors import ConfigError
from gyre.runtime.shared.checks import Site, Where
from gyre.runtime.shared.layout import Component, Layout

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig

Mode = Literal["disjoint", "colocated"]
MODES: tuple[Mode, ...] = ("disjoint", "colocated")

LOCAL_RANK_VARIABLES = (
    "SLURM_LOCALID",  # srun
    "MPI_LOCALRANKID",  # MPICH / Hydra, Intel MPI
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
    "LOCAL_RANK",  # torchrun
)
"""Environment variables that carry a rank's index on its node, in the order they are read."""

RANKS_PER_CPU = 8
"""`gyre run` starts every rank on this machine: at most this many per CPU (the default job
runs 5 ranks + 3 engine processes on 2 CPUs, 2-rank cells 8 + 3)."""


@dataclass(frozen=True, slots=True)
class EngineGpus:
    """The GPUs of one engine on one node: SGLang's `--base-gpu-id` and the `tensor_parallel`
    GPUs it uses there; `engine` is its index in the cell (j), `node_rank` which of its
    `engine.nodes` nodes this is (`--node-rank`: 0 serves HTTP, the others only compute)."""

    base_gpu_id: int
    gpus: tuple[int, ...]
    engine: int = 0
    node_rank: int = 0


@dataclass(frozen=True, slots=True)
class RankDevice:
    """One local rank's placement."""

    local_rank: int
    component: Component
    device: str
    """cuda:N or cpu: the rank's torch device (`torch.cuda.set_device` when cuda)."""
    engine: EngineGpus | None = None
    """The GPUs of the engine (or the node rank of one) this rank hosts: a cell's engine hosts
    (`engine_hosts`) and standalone engines."""
    offload: bool = False
    """The trainer shares its GPU with an engine: release on to_rollout, restore on to_train."""


@dataclass(frozen=True, slots=True)
class NodePlan:
    """Every local rank's placement on one node."""

    mode: Mode
    gpus: int
    ranks: tuple[RankDevice, ...]
    used: int = field(default=0)
    """GPUs the plan uses (the rest stay free)."""

    def __getitem__(self, local_rank: int) -> RankDevice:
        return self.ranks[local_rank]


def engine_hosts(per_cell: int, tensor_parallel: int, nodes: int = 1) -> dict[int, tuple[int, int]]:
    """The cell ranks (shards) that launch its engines, each with (engine j, node rank k):
    engine j spans the cell's ranks j x tensor_parallel x nodes on, and its node rank k is
    launched by the rank tensor_parallel x k further on (`engine.nodes` > 1: one node each)."""
    span = tensor_parallel * nodes
    return {j * span + k * tensor_parallel: (j, k) for j in range(per_cell) for k in range(nodes)}


@dataclass(slots=True)
class _Group:
    """A cell's ranks on this node, or one standalone engine: one contiguous block of GPUs."""

    trainers: list[int] = field(default_factory=list)  # local ranks, by shard
    engines: list[tuple[int, int, int]] = field(default_factory=list)
    """(position among `trainers`, engine j, node rank k) of each engine part launched here."""
    standalone: int | None = None  # local rank of a standalone / judge engine

    def offsets(self, tp: int, mode: Mode) -> list[int]:
        """Each engine part's first GPU, from the block's start: colocated on the GPUs of its
        host rank and the ranks after it, disjoint after the trainers' GPUs."""
        if mode == "colocated" or not self.trainers:
            return [p for p, _, _ in self.engines]
        return [len(self.trainers) + i * tp for i in range(len(self.engines))]

    def size(self, tp: int, mode: Mode) -> int:
        ends = [o + tp for o in self.offsets(tp, mode)]
        return max([len(self.trainers), *ends])


def plan_node(
    gpus: int, ranks: Sequence[Component], *, tensor_parallel: int, mode: Mode,
    per_cell: int = 1, nodes: int = 1,
) -> NodePlan:  # fmt: skip
    """The devices of the node's ranks (`ranks[i]` is local rank i's component); a cell runs
    `per_cell` engines of `nodes` nodes each (`engine_hosts`)."""
    if mode not in MODES:
        raise ConfigError(f"placement mode: {mode!r}; allowed: {', '.join(MODES)}")
    if tensor_parallel < 1 or gpus < 0 or per_cell < 1 or nodes < 1:
        raise ConfigError(f"tensor_parallel: {tensor_parallel}, gpus: {gpus}, per_cell: "
                          f"{per_cell}, nodes: {nodes}; allowed: >= 1, >= 0, >= 1, >= 1")  # fmt: skip
    groups = _groups(ranks, engine_hosts(per_cell, tensor_parallel, nodes))
    out = {i: RankDevice(i, c, "cpu") for i, c in enumerate(ranks)}
    if gpus == 0:
        return NodePlan(mode=mode, gpus=0, ranks=tuple(out[i] for i in range(len(ranks))))
    need = sum(g.size(tensor_parallel, mode) for g in groups)
    if need > gpus:
        raise ConfigError(_too_few(gpus, need, groups, tensor_parallel, mode))
    base = 0
    for g in groups:
        _place_group(g, base, tensor_parallel, mode, out)
        base += g.size(tensor_parallel, mode)
    return NodePlan(mode=mode, gpus=gpus, ranks=tuple(out[i] for i in range(len(ranks))), used=base)


def _groups(ranks: Sequence[Component], hosts: dict[int, tuple[int, int]]) -> list[_Group]:
    """Cells (by id, trainers by shard, the engine parts their ranks launch) then the pool's
    engines: standalone, then judge engines (by index)."""
    cells: dict[int, _Group] = {}
    standalone: dict[tuple[bool, int], _Group] = {}
    for i in sorted(range(len(ranks)), key=lambda i: (ranks[i].index, ranks[i].shard)):
        c = ranks[i]
        if c.kind == "cell":
            g = cells.setdefault(c.index, _Group())
            if c.shard in hosts:
                g.engines.append((len(g.trainers), *hosts[c.shard]))
            g.trainers.append(i)
        elif c.kind in ("standalone", "judge"):
            key = (c.kind == "judge", c.index)
            if key in standalone:
                raise ConfigError(f"{c.kind} engine {c.index}: on two local ranks")
            standalone[key] = _Group(engines=[(0, 0, 0)], standalone=i)
    return [cells[k] for k in sorted(cells)] + [standalone[k] for k in sorted(standalone)]


def _place_group(
    g: _Group, base: int, tensor_parallel: int, mode: Mode, out: dict[int, RankDevice]
) -> None:
    parts = [EngineGpus(base + o, tuple(range(base + o, base + o + tensor_parallel)), j, k)
             for o, (_, j, k) in zip(g.offsets(tensor_parallel, mode), g.engines)]  # fmt: skip
    engine_gpus = {gpu for e in parts for gpu in e.gpus}
    for pos, rank in enumerate(g.trainers):
        gpu = base + pos
        out[rank] = RankDevice(rank, out[rank].component, f"cuda:{gpu}",
                               offload=gpu in engine_gpus)  # fmt: skip
    for (pos, _, _), engine in zip(g.engines, parts):
        rank = g.trainers[pos] if g.standalone is None else g.standalone
        r = out[rank]
        device = r.device if g.standalone is None else f"cuda:{engine.base_gpu_id}"
        out[rank] = RankDevice(r.local_rank, r.component, device, engine, r.offload)


def _too_few(gpus: int, need: int, groups: list[_Group], tp: int, mode: Mode) -> str:
    trainers = sum(len(g.trainers) for g in groups)
    engines = sum(len(g.engines) for g in groups)
    rule = (
        "trainer ranks + engines x tensor_parallel"
        if mode == "disjoint"
        else "per cell its trainer ranks, or more where its engines reach past them, plus "
        "standalone engines x tensor_parallel"
    )
    return (
        f"this node has {gpus} GPUs but {mode} placement of its {trainers} trainer ranks and "
        f"{engines} engines with tensor_parallel {tp} needs {need} ({rule}); put fewer ranks "
        f"or engines on the node (engine.per_cell), use colocated placement, or lower "
        f"engine.tensor_parallel"
    )


def local_rank(env: Mapping[str, str], world: Any | None = None, *, kind: int | None = None) -> int:
    """This rank's index on its node: the launcher's variable (`LOCAL_RANK_VARIABLES`), else
    its rank in the node's shared-memory split of `world` (collective over `world`)."""
    for name in LOCAL_RANK_VARIABLES:
        value = env.get(name)
        if value is None or value == "":
            continue
        if not value.isdigit():
            raise ConfigError(f"{name}={value!r}; allowed: a local rank >= 0")
        return int(value)
    if world is None:
        raise ConfigError(
            f"no local rank: none of {', '.join(LOCAL_RANK_VARIABLES)} is set and no MPI "
            "communicator was given"
        )
    shared = _split_shared(world, kind)
    try:
        return int(shared.Get_rank())
    finally:
        shared.Free()


def node_ranks(world: Any, env: Mapping[str, str], *, kind: int | None = None) -> list[int]:
    """The world ranks on this node, indexed by local rank (collective over `world`)."""
    me = local_rank(env, world, kind=kind)
    shared = _split_shared(world, kind)
    try:
        pairs = sorted(shared.allgather((me, int(world.Get_rank()))))
    finally:
        shared.Free()
    found = [lr for lr, _ in pairs]
    if found != list(range(len(pairs))):
        raise ConfigError(f"local ranks on this node are {found}; expected 0..{len(pairs) - 1}")
    return [r for _, r in pairs]


def _split_shared(world: Any, kind: int | None) -> Any:
    if kind is None:
        from mpi4py import MPI

        kind = MPI.COMM_TYPE_SHARED
    return world.Split_type(kind, key=int(world.Get_rank()))


def check_gpus(cfg: RunConfig, gpus: int, nodes_per_cell: int, standalone_nodes: int) -> None:
    """Every node of the job places its ranks and engine on `gpus` GPUs, as the ranks will."""
    if not cfg.uses_gpus:
        return
    why = _why_gpus(cfg)
    if gpus == 0:
        raise ConfigError(f"slurm.gpus_per_node: 0, but {why} runs on GPUs; allowed: the GPUs "
                          "of each cell node (>= 1), or engine.backend=embedded with "
                          "train.device=cpu on a CPU cluster")  # fmt: skip
    t = cfg.topology
    if nodes_per_cell < 1 or t.ranks_per_cell % nodes_per_cell:
        return  # the layout's own check names it (gyre.launch.spec.job_spec)
    per_node = t.ranks_per_cell // nodes_per_cell
    nodes = [[Component("cell", 0, shard) for shard in range(k * per_node, (k + 1) * per_node)]
             for k in range(nodes_per_cell)]  # fmt: skip
    if t.pool and (standalone_nodes < 1 or t.pool % standalone_nodes):
        return  # the layout's own check names it (gyre.launch.spec.job_spec)
    if t.pool:  # the engine pool's busiest node: standalone and judge engines alike
        nodes.append([Component("standalone", i) for i in range(t.pool // standalone_nodes)])
    check_engine_nodes(cfg, per_node)
    for ranks in nodes:
        try:
            plan_node(gpus, ranks, **_engines(cfg))
        except ConfigError as e:
            raise ConfigError(f"slurm.gpus_per_node {gpus}: {e} ({why})") from None


def check_engine_nodes(cfg: RunConfig, per_node: int) -> None:
    """Each node rank of a cell's multi-node engine (`engine.nodes` > 1) is launched on a node
    of its own, with a cell's ranks `per_node` to a node (shard s on node s // per_node)."""
    e = cfg.engine
    for shard, (j, k) in engine_hosts(cfg.engines_per_cell, e.tensor_parallel, e.nodes).items():
        if k and shard // per_node == (shard - e.tensor_parallel) // per_node:
            raise ConfigError(
                f"engine.nodes {e.nodes}: node ranks {k - 1} and {k} of a cell's engine {j} "
                f"(launched by its ranks {shard - e.tensor_parallel} and {shard}) fall on one node, "
                f"which holds {per_node} of the cell's ranks; allowed: engine.tensor_parallel "
                f"{per_node} (the ranks of one node) with engine.nodes > 1, or engine.nodes 1 "
                f"with engine.tensor_parallel up to {per_node}"
            )


def _engines(cfg: RunConfig) -> dict[str, Any]:
    """`plan_node`'s engine arguments for the run's cells."""
    return {"tensor_parallel": cfg.engine.tensor_parallel, "mode": cfg.topology.placement,
            "per_cell": cfg.engines_per_cell, "nodes": cfg.engine.nodes}  # fmt: skip


def check_ranks_here(cfg: RunConfig, site: Site) -> list[str]:
    """`gyre run`: refuse a world it cannot start on this machine (a cluster template)."""
    t = cfg.topology
    cpus = os.cpu_count() or 1
    if site.where is not Where.HERE or t.world_size <= RANKS_PER_CPU * cpus:
        return []
    raise ConfigError(
        f"topology: {t.world_size} ranks (1 coordinator + 1 proxy + {t.cells} cells x "
        f"{t.ranks_per_cell} ranks + {t.standalone_engines} standalone + {t.judge_engines} judge "
        f"engines); gyre run "
        f"starts them all on this machine, which has {cpus} CPUs; allowed: at most "
        f"{RANKS_PER_CPU * cpus} ranks here. Run a cluster config with `gyre submit "
        "CONFIG` or `gyre render CONFIG -o job.sbatch && sbatch job.sbatch`, or shrink it "
        "(topology.cells=3 topology.ranks_per_cell=1)"
    )


def check_devices_here(cfg: RunConfig, site: Site) -> list[str]:
    """`gyre run`: this machine runs the backends (`RunConfig.check_machine`), and its CUDA
    devices place every rank and engine of the job, as each rank's `place_rank` will
    (`torch.cuda.device_count()`, then `plan_node` over the whole world)."""
    if site.where is not Where.HERE:
        return []
    cfg.check_machine()
    if not cfg.uses_gpus:
        return []
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:  # an SGLang engine without CUDA is refused by `check_machine` first
        raise ConfigError(f"train.device: {cfg.train.device!r}, but this machine has no CUDA "
                          "GPU (torch.cuda.device_count() is 0); allowed here: train.device=cpu")  # fmt: skip
    try:
        if cfg.engine.nodes > 1:
            raise ConfigError(f"engine.nodes {cfg.engine.nodes}: an engine on several nodes, but "
                              "gyre run starts every rank on this one; allowed here: 1")  # fmt: skip
        plan_node(gpus, Layout(cfg.topology).components, **_engines(cfg))
    except ConfigError as e:
        raise ConfigError(f"{_why_gpus(cfg)} on this machine's {gpus} GPUs: {e}") from None
    return []


def _why_gpus(cfg: RunConfig) -> str:
    if cfg.engine.backend == "sglang":
        return f"engine.backend sglang (tensor_parallel {cfg.engine.tensor_parallel})"
    return f"train.device {cfg.train.device}"
