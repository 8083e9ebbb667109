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
    """The GPUs of one engine: SGLang's `--base-gpu-id` and the `tensor_parallel` GPUs it uses."""

    base_gpu_id: int
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankDevice:
    """One local rank's placement."""

    local_rank: int
    component: Component
    device: str
    """cuda:N or cpu: the rank's torch device (`torch.cuda.set_device` when cuda)."""
    engine: EngineGpus | None = None
    """The GPUs of the engine this rank hosts (cell leaders and standalone engines)."""
    offload: bool = False
    """The trainer shares its GPU with the engine: release on to_rollout, restore on to_train."""


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


@dataclass(slots=True)
class _Group:
    """A cell's ranks on this node, or one standalone engine: one contiguous block of GPUs."""

    trainers: list[int] = field(default_factory=list)  # local ranks, by shard
    engine: int | None = None  # local rank hosting the engine

    def size(self, tensor_parallel: int, mode: Mode) -> int:
        tp = tensor_parallel if self.engine is not None else 0
        return len(self.trainers) + tp if mode == "disjoint" else max(len(self.trainers), tp)


def plan_node(
    gpus: int, ranks: Sequence[Component], *, tensor_parallel: int, mode: Mode
) -> NodePlan:
    """The devices of the node's ranks (`ranks[i]` is local rank i's component)."""
    if mode not in MODES:
        raise ConfigError(f"placement mode: {mode!r}; allowed: {', '.join(MODES)}")
    if tensor_parallel < 1 or gpus < 0:
        raise ConfigError(
            f"tensor_parallel: {tensor_parallel}, gpus: {gpus}; allowed: >= 1 and >= 0"
        )
    groups = _groups(ranks)
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


def _groups(ranks: Sequence[Component]) -> list[_Group]:
    """Cells (by id, trainers by shard) then the pool's engines: standalone, then judge
    engines (by index)."""
    cells: dict[int, _Group] = {}
    standalone: dict[tuple[bool, int], _Group] = {}
    for i in sorted(range(len(ranks)), key=lambda i: (ranks[i].index, ranks[i].shard)):
        c = ranks[i]
        if c.kind == "cell":
            g = cells.setdefault(c.index, _Group())
            g.trainers.append(i)
            if c.shard == 0:
                g.engine = i
        elif c.kind in ("standalone", "judge"):
            key = (c.kind == "judge", c.index)
            if key in standalone:
                raise ConfigError(f"{c.kind} engine {c.index}: on two local ranks")
            standalone[key] = _Group(engine=i)
    return [cells[k] for k in sorted(cells)] + [standalone[k] for k in sorted(standalone)]


def _place_group(
    g: _Group, base: int, tensor_parallel: int, mode: Mode, out: dict[int, RankDevice]
) -> None:
    trainer_gpus = [base + k for k in range(len(g.trainers))]
    engine_base = base + len(g.trainers) if mode == "disjoint" else base
    engine = EngineGpus(engine_base, tuple(range(engine_base, engine_base + tensor_parallel)))
    for rank, gpu in zip(g.trainers, trainer_gpus):
        shared = g.engine is not None and gpu in engine.gpus
        out[rank] = RankDevice(rank, out[rank].component, f"cuda:{gpu}", offload=shared)
    if g.engine is not None:
        r = out[g.engine]
        device = r.device if g.trainers else f"cuda:{engine_base}"
        out[g.engine] = RankDevice(r.local_rank, r.component, device, engine, r.offload)


def _too_few(gpus: int, need: int, groups: list[_Group], tp: int, mode: Mode) -> str:
    trainers = sum(len(g.trainers) for g in groups)
    engines = sum(g.engine is not None for g in groups)
    rule = (
        "trainer ranks + engines x tensor_parallel"
        if mode == "disjoint"
        else "per cell max(its trainer ranks, tensor_parallel), plus standalone engines x "
        "tensor_parallel"
    )
    return (
        f"this node has {gpus} GPUs but {mode} placement of its {trainers} trainer ranks and "
        f"{engines} engines with tensor_parallel {tp} needs {need} ({rule}); put fewer ranks "
        f"on the node, use colocated placement, or lower engine.tensor_parallel"
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
    for ranks in nodes:
        try:
            plan_node(gpus, ranks, tensor_parallel=cfg.engine.tensor_parallel,
                      mode=cfg.topology.placement)  # fmt: skip
        except ConfigError as e:
            raise ConfigError(f"slurm.gpus_per_node {gpus}: {e} ({why})") from None


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
        plan_node(gpus, Layout(cfg.topology).components,
                  tensor_parallel=cfg.engine.tensor_parallel, mode=cfg.topology.placement)  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{_why_gpus(cfg)} on this machine's {gpus} GPUs: {e}") from None
    return []


def _why_gpus(cfg: RunConfig) -> str:
    if cfg.engine.backend == "sglang":
        return f"engine.backend sglang (tensor_parallel {cfg.engine.tensor_parallel})"
    return f"train.device {cfg.train.device}"
