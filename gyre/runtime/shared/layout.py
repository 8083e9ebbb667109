"""The topology of the one MPI world and which component each rank runs (pure; the runtime
and the launcher both use it).

World layout (docs/runtime.md): rank 0 the coordinator, rank 1 the proxy node (with the
harness pool), ranks 2 .. 2+K*R-1 the cells (cell c holds ranks 2+c*R .. 2+c*R+R-1, R ranks
per cell), then the engine pool: the standalone rollout engines, then the judge engines
(`judge_engines`: they serve the judge rule's model and are never trained nor published to),
one rank each.

    Layout(cfg.topology).components[3]  ->  Component(kind="cell", index=1, shard=0)
    Layout(cfg.topology).groups[3]      ->  RankGroup(kind="cell", index=1, first=3, size=1)
    Layout(cfg.topology).ranks.cells[1] ->  (3,)   (the ranks of cell 1, the leader first)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gyre.errors import ConfigError

COORDINATOR_RANK = 0
PROXY_RANK = 1


@dataclass(kw_only=True, slots=True)
class TopologyConfig:
    """Which processes the MPI world holds besides the coordinator and the proxy node.

    Shared by the runtime and the launcher (which sizes the job from it). A cluster cell
    holds one rank per GPU; on CPU a cell's ranks are processes. Either way the R ranks of a
    cell are one training replica (gradients summed inside the cell) and rank 0 of the cell,
    its leader, hosts the cell's rollout engine and speaks for the cell.
    """

    cells: int = 3
    """K: elastic cells; cell 0 is the core."""
    ranks_per_cell: int = 1
    """R: MPI ranks of one cell (on a GPU cluster: one per GPU of the cell)."""
    standalone_engines: int = 0
    """Rollout engines that never switch (one rank each)."""
    judge_engines: int = 0
    """Engines that serve the `judge` scoring rule (one rank each, placed and sized like a
    standalone engine): the run's model at its initial weights, never trained, never
    published to, never in the rollout fleet; a task whose `scoring.judge` names no
    endpoint is scored by them."""
    placement: Literal["colocated", "disjoint"] = "colocated"
    """GPUs of a node (gyre.runtime.shared.placement): colocated — a cell's trainer ranks share its
    engine's GPUs and leave them on every switch to rollout; disjoint — separate GPUs."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU (1 GB = 1e9 bytes): the limit the memory plan holds every GPU rank
    and engine to (`gyre plan --memory`, the preflight's memory check)."""
    cpu_memory_gb: float | None = None
    """On the CPU: the memory one cell rank may use (GB); None: the plan is printed, not
    enforced."""
    zygote: bool = True
    """`gyre run` on one machine without a GPU: every rank forked from one process that has
    imported what ranks import (`gyre.zygote`), not each a new interpreter; false: new ones."""

    def __post_init__(self) -> None:
        if self.cells < 1:
            raise ConfigError(f"cells: {self.cells}; allowed: an integer >= 1")
        if self.ranks_per_cell < 1:
            raise ConfigError(f"ranks_per_cell: {self.ranks_per_cell}; allowed: an integer >= 1")
        if self.placement not in ("colocated", "disjoint"):
            raise ConfigError(f"placement: {self.placement!r}; allowed: colocated, disjoint")
        for name in ("gpu_memory_gb", "cpu_memory_gb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}: {value!r}; allowed: a number of GB > 0")
        for name in ("standalone_engines", "judge_engines"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: {getattr(self, name)}; allowed: >= 0")

    @property
    def world_size(self) -> int:
        """1 coordinator + 1 proxy node + K*R cell ranks + the engine pool."""
        return 2 + self.cells * self.ranks_per_cell + self.pool

    @property
    def pool(self) -> int:
        """Ranks of the engine pool: the standalone engines, then the judge engines."""
        return self.standalone_engines + self.judge_engines


@dataclass(frozen=True, slots=True)
class Component:
    """What one rank runs: its kind, the cell / engine index and its shard within a cell."""

    kind: Literal["coordinator", "proxy", "cell", "standalone", "judge"]
    index: int = 0
    shard: int = 0


@dataclass(frozen=True, slots=True)
class RankGroup:
    """Consecutive world ranks that run one kind of component: one component of the
    heterogeneous Slurm job (the coordinator, the proxy node, one cell, the engine pool).

    The engine pool ("standalone") holds the standalone engines, then its last `judges`
    ranks the judge engines: a judge engine is placed and sized like a standalone engine,
    so it shares the pool's nodes (`slurm.standalone_nodes`) rather than asking for a
    Slurm component of its own."""

    kind: Literal["coordinator", "proxy", "cell", "standalone"]
    index: int  # the cell id of a cell; 0 otherwise
    first: int  # its first world rank
    size: int  # its ranks
    judges: int = 0  # the engine pool: its last ranks serving the judge

    def component(self, rank_in_group: int) -> Component:
        """What the group's `rank_in_group`-th rank runs."""
        if not 0 <= rank_in_group < self.size:
            raise ConfigError(f"{self.kind} group: rank {rank_in_group}; it has {self.size}")
        if self.kind == "standalone":
            rollout = self.size - self.judges
            if rank_in_group >= rollout:
                return Component("judge", rank_in_group - rollout)
            return Component("standalone", rank_in_group)
        return Component(self.kind, self.index, rank_in_group)


@dataclass(frozen=True, slots=True)
class Layout:
    """The one layout of a job's world, from its topology: the launcher sizes the het job's
    components from `groups`, the sbatch renderer writes them, every rank finds what it runs
    in `components` (and a Slurm task its group's), the coordinator its cells' ranks."""

    topology: TopologyConfig

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def groups(self) -> list[RankGroup]:
        """The world's groups in rank order: coordinator, proxy, cells 0..K-1, then (if any)
        the engine pool (standalone engines, then judge engines)."""
        t = self.topology
        out = [RankGroup("coordinator", 0, 0, 1), RankGroup("proxy", 0, 1, 1)]
        out += [RankGroup("cell", c, 2 + c * t.ranks_per_cell, t.ranks_per_cell)
                for c in range(t.cells)]  # fmt: skip
        if t.pool:
            first = 2 + t.cells * t.ranks_per_cell
            out.append(RankGroup("standalone", 0, first, t.pool, judges=t.judge_engines))
        return out

    @property
    def components(self) -> list[Component]:
        """What every world rank runs, by rank."""
        return [g.component(r) for g in self.groups for r in range(g.size)]

    def check(self, world_size: int) -> list[Component]:
        """`components` of a world of `world_size` ranks; the wrong size is a ConfigError."""
        t = self.topology
        if world_size != self.world_size:
            raise ConfigError(
                f"world size {world_size} does not match the topology: 1 coordinator + 1 proxy + "
                f"{t.cells} cells x {t.ranks_per_cell} ranks + {t.standalone_engines} standalone "
                f"+ {t.judge_engines} judge engines = {self.world_size} ranks; start {self.world_size} ranks (mpiexec -n "
                f"{self.world_size}) or change `topology`"
            )
        return self.components

    def component_at(self, group: int, rank_in_group: int) -> Component:
        """What a task of het group `group` runs (Slurm numbers the groups in this order)."""
        groups = self.groups
        if not 0 <= group < len(groups):
            raise ConfigError(f"het group {group}: the layout has {len(groups)} groups")
        return groups[group].component(rank_in_group)

    @property
    def ranks(self) -> Ranks:
        """Where the coordinator sends: each engine's rank and each cell's ranks (one
        engine per cell, on its leader)."""
        return Ranks.of(self.components)

    def serving(self, shards: tuple[int, ...]) -> Ranks:
        """`ranks` for cells whose engines run on these shards (`engine_shards`)."""
        return Ranks.of(self.components, shards)


@dataclass(frozen=True, slots=True)
class Ranks:
    """The world ranks the coordinator talks to, by what they run: the rank speaking for each
    engine id (the cells' leaders, then the standalone engines), every rank of each cell
    (the leader first: training and role messages go to all of them, the leader answers)
    and the judge engines' ranks (outside the rollout fleet: only told to stop)."""

    engines: tuple[int, ...]
    cells: tuple[tuple[int, ...], ...]
    judges: tuple[int, ...] = ()

    @classmethod
    def of(cls, components: list[Component], shards: tuple[int, ...] = (0,)) -> Ranks:
        judges = tuple(r for r, c in enumerate(components) if c.kind == "judge")
        return cls(tuple(engine_ranks(components, shards)),
                   tuple(map(tuple, cell_members(components))), judges)  # fmt: skip

    @classmethod
    def one_per_cell(cls, engines: list[int], cells: int) -> Ranks:
        """A world whose `cells` cells are one rank each: the first `cells` of `engines`."""
        return cls(tuple(engines), tuple((r,) for r in engines[:cells]))

    @property
    def core(self) -> int:
        """The core's leader (engine 0): it publishes and saves the policy."""
        return self.engines[0]

    @property
    def followers(self) -> list[int]:
        """Every rank of a cell but its leader, cell by cell."""
        return [r for members in self.cells for r in members[1:]]

    @property
    def cells_and_engines(self) -> list[int]:
        """Every rank but the coordinator and the proxy node, once each: the engines', the
        followers (one hosting an engine is already named), then the judge engines (the ranks
        told to stop at the end of a run)."""
        return list(dict.fromkeys([*self.engines, *self.followers, *self.judges]))

    def by_cell(self, per_rank: list[str]) -> list[list[str]]:
        """A per-rank list (e.g. hosts) regrouped as each cell's ranks are."""
        return [[per_rank[r] for r in members] for members in self.cells]


def layout(world_size: int, topology: TopologyConfig) -> list[Component]:
    """The component of every rank (`Layout.check`)."""
    return Layout(topology).check(world_size)


def cell_of_rank(components: list[Component]) -> list[int | None]:
    """Per rank: its cell id (None for the coordinator, proxy and standalone engines)."""
    return [c.index if c.kind == "cell" else None for c in components]


def cell_ranks(components: list[Component]) -> list[int]:
    """World rank of shard 0 (the leader) of each cell, by cell id."""
    return [r for r, c in enumerate(components) if c.kind == "cell" and c.shard == 0]


def cell_members(components: list[Component]) -> list[list[int]]:
    """World ranks of each cell, by cell id, in shard order (the leader first)."""
    cells = max((c.index for c in components if c.kind == "cell"), default=-1) + 1
    return [[r for r, c in enumerate(components) if c.kind == "cell" and c.index == i]
            for i in range(cells)]  # fmt: skip


def engine_ranks(components: list[Component], shards: tuple[int, ...] = (0,)) -> list[int]:
    """World rank hosting each engine id: the cells' first (cell c's engines c·E .. c·E+E-1
    on its ranks `shards`, E = len(shards)), then the standalone engines."""
    where = {(c.index, c.shard): r for r, c in enumerate(components) if c.kind == "cell"}
    cells = max((i for i, _ in where), default=-1) + 1
    hosts = [where[(i, s)] for i in range(cells) for s in shards]
    return hosts + [r for r, c in enumerate(components) if c.kind == "standalone"]


def engine_shards(per_cell: int, stride: int) -> tuple[int, ...]:
    """The ranks of a cell (its shards) hosting its `per_cell` engines: engine j on shard
    j x `stride` (an engine's tensor_parallel x nodes ranks: `RunConfig.engine_ranks`)."""
    return tuple(j * stride for j in range(per_cell))


def hosts_engine(component: Component, shards: tuple[int, ...]) -> bool:
    """Whether the rank running `component` starts an engine: a cell's leader and its other
    engine-hosting shards (`engine_shards`), a standalone or a judge engine."""
    if component.kind == "cell":
        return component.shard == 0 or component.shard in shards
    return component.kind in ("standalone", "judge")


def engine_of(cell: int, shard: int, shards: tuple[int, ...]) -> int | None:
    """The engine id a cell rank hosts (None if it hosts none)."""
    return cell * len(shards) + shards.index(shard) if shard in shards else None
