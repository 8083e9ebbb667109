"""Each rank's role in a Gyre job, built from the run config and the rank's wiring.

`gyre.runtime.main.run_component` reads parse → build → serve → close: every rank first
connects its `Wiring` (communicators, address, control link, device placement — collective,
the same order everywhere), then builds the role of its component kind (`ROLES`), which
serves until the run ends:

    coordinator  CoordinatorRole   schedules, records the trace, prints the summary
    proxy        ProxyRole         the proxy, the harness pool and the evaluator
    cell         EngineRole        the leader: its engine and its replica's shard 0
                 FollowerRole      the other ranks: their shards, stepped by the leader
    standalone   EngineRole        an engine that stays in rollout
    judge        JudgeRole         an engine that serves the judge rule (never trained,
                                   never published to, outside the rollout fleet)

A cell leader spawns its engine first and builds its replica while the engine loads —
unless the cell's trainers share their GPUs with the engine (`Wiring.parks_first`: a CUDA
trainer in colocated placement): then every rank of the cell builds its replica, parks it
on the host (`TrainerResidency`) and waits for the others, and only then does the leader
start the engine, which so finds the GPUs' memory free.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gyre.runtime.shared.config import RunConfig
from gyre.runtime.shared.layout import (
    COORDINATOR_RANK,
    Component,
    Layout,
    cell_of_rank,
    engine_of,
    engine_shards,
)
from gyre.runtime.shared.placement import RankDevice
from gyre.runtime.shared.startup import StartupClock

if TYPE_CHECKING:  # torch: imported only by the ranks that train
    from gyre.runtime.cell.residency import TrainerResidency


@dataclass(frozen=True, slots=True)
class Wiring:
    """What every rank builds before its role, in the same order on every rank (each step
    is collective over the world)."""

    components: list[Component]
    comms: Any  # gyre.train.comm.Communicators: per-cell Split and the K-1 prefix sets
    address: str  # how other ranks reach this one: its engine's URL, control, snapshots
    link: Any  # gyre.runtime.shared.wire.Link: the control channel (MPI stays for collectives)
    hosts: list[str]  # where every rank runs: its Slurm node (else host), for the trace
    placed: RankDevice  # this rank's device and its engine's GPUs
    residency: TrainerResidency | None  # a GPU trainer's offload on each switch to rollout
    clock: StartupClock  # this rank's start-up phases (gyre.runtime.shared.startup)
    parks_first: bool = False
    """The cell's trainers share their GPUs with its engine (a CUDA trainer, colocated
    placement; the same on every rank of a cell): the cell's ranks build and park their
    trainers before the leader starts the engine."""
    dist_init: str = ""
    """SGLang's --dist-init-addr of the multi-node engine this rank launches a node rank of
    (`rendezvous`); empty otherwise."""

    @classmethod
    def connect(
        cls, cfg: RunConfig, world: Any, components: list[Component], clock: StartupClock
    ) -> Wiring:
        from gyre.runtime.shared import wire
        from gyre.runtime.shared.address import node_address
        from gyre.train.comm import build_communicators

        comms = build_communicators(world, cell_of_rank=cell_of_rank(components))
        address = node_address(world)
        link = wire.connect(world, address)
        hosts = world.allgather(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        placed = place_rank(cfg, world, components)
        residency, parks_first = None, False
        if cfg.train.device.startswith("cuda"):  # else the trainer stays on the CPU
            from gyre.runtime.cell.residency import TrainerResidency

            residency = TrainerResidency.for_rank(placed)
            parks_first = cfg.topology.placement == "colocated"  # a leader's GPU is shared
        dist_init = rendezvous(cfg, world, components, address, placed)
        clock.mark("wiring")
        return cls(components, comms, address, link, hosts, placed, residency, clock,
                   parks_first, dist_init)  # fmt: skip

    def report_startup(self, me: Component) -> None:
        """Tell the coordinator this rank's start-up phases (it serves from now on)."""
        rank = self.components.index(me)
        self.link.send(self.clock.report(rank, label(me)), COORDINATOR_RANK)


class RankRole(Protocol):
    """A rank's component, built: what it shares with the snapshot transport (a cell's
    parameters, `snapshot_buffer`) and how it serves until the run ends. (A cell's rollout
    or training role, the paper's, is `gyre.vocabulary.Role`.)"""

    @property
    def flat(self) -> Any: ...

    def serve(self, link: Any, transport: Any) -> int: ...


class CoordinatorRole:
    """Rank 0: schedules the run, records its trace, prints the summary line."""

    flat = None

    def __init__(self, cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> None:
        import gyre.runtime.coordinator.coordinator  # noqa: F401  (imported while the cells build)

        self.cfg, self.wiring, self.run_dir = cfg, wiring, run_dir
        wiring.clock.mark("role imports")  # the scheduler, h5py, the trackers' code

    def serve(self, link: Any, transport: Any) -> int:
        from gyre import provenance
        from gyre.runtime.coordinator.coordinator import Coordinator

        clock, cfg, components = self.wiring.clock, self.cfg, self.wiring.components
        meta = {"config": (self.run_dir / "config.yaml").read_text(),
                "world_size": len(components), "hosts": self.wiring.hosts,
                "model": cfg.model, **provenance()}  # fmt: skip
        ranks = Layout(cfg.topology).serving(shards(cfg))
        coordinator = Coordinator(cfg, link, self.run_dir, ranks, meta, startup=clock)
        clock.mark("trace open")  # the trace, the trackers
        try:
            summary = coordinator.run()
        finally:  # a failed run still leaves its trackers' files closed
            coordinator.tracker.close()
        print("GYRE-SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "steps"}),
              flush=True)  # fmt: skip
        return int(summary["status"])


class ProxyRole:
    """Rank 1: the proxy, the harness pool and the evaluator."""

    flat = None

    def __init__(self, cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> None:
        import gyre.runtime.proxy_node.node  # noqa: F401  (imported while the cells build)

        self.cfg, self.wiring, self.me, self.run_dir = cfg, wiring, me, run_dir
        wiring.clock.mark("role imports")  # tornado, the proxy app, the harness pool

    def serve(self, link: Any, transport: Any) -> int:
        from gyre.runtime.proxy_node.node import run_proxy_node

        self.wiring.report_startup(self.me)  # its start ends at ProxyReady, timed there
        return run_proxy_node(self.cfg, link, self.run_dir)


class EngineRole:
    """A cell's leader (its engine and its replica's shard 0) or a standalone engine."""

    def __init__(self, cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> None:
        import gyre.runtime.cell.engine_host  # noqa: F401  (torch)
        from gyre.runtime.shared.checkpoint import latest

        self.cfg, self.wiring, self.me, self.run_dir = cfg, wiring, me, run_dir
        wiring.clock.mark("role imports")
        self.replica, self.version = None, 0
        cell = me.kind == "cell"
        if cell and wiring.parks_first:  # the engine starts on the GPUs the trainers left
            self.replica, self.version = _build_replica(cfg, wiring, me, run_dir)
        self.engine = _start_engine(cfg, me, run_dir, wiring.address, wiring.placed,
                                    wiring.dist_init)  # fmt: skip
        wiring.clock.mark("engine spawn")
        if cell and self.replica is None:  # it builds while the engine loads
            self.replica, self.version = _build_replica(cfg, wiring, me, run_dir)
        if not cell and (found := latest(run_dir)) is not None:  # a standalone engine
            self.version = int(found[1]["version"])  # resumes there

    @property
    def flat(self) -> Any:
        return snapshot_buffer(self.replica, self.wiring.residency)

    def serve(self, link: Any, transport: Any) -> int:
        from gyre.runtime.cell.leader import CellProcess

        k, me = self.cfg.topology.cells * self.cfg.engines_per_cell, self.me
        return CellProcess(
            self.cfg, engine_index=me.index * self.cfg.engines_per_cell if me.kind == "cell"
            else k + me.index, cell=me.index if me.kind == "cell" else None,
            comms=self.wiring.comms, run_dir=self.run_dir, engine=self.engine,
            replica=self.replica, transport=transport, version=self.version,
            residency=self.wiring.residency if self.replica is not None else None,
            clock=self.wiring.clock, started=lambda: self.wiring.report_startup(self.me),
        ).serve(link)  # fmt: skip


class FollowerRole:
    """A cell rank other than the leader: its replica's shard, stepped by the leader, and
    one of the cell's engines if it hosts one (`engine_shards`)."""

    def __init__(self, cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> None:
        self.cfg, self.wiring, self.me, self.run_dir = cfg, wiring, me, run_dir
        self.engine_index = engine_of(me.index, me.shard, shards(cfg))
        self.engine = None
        if self.engine_index is not None and wiring.parks_first:
            self.replica, self.version = _build_replica(cfg, wiring, me, run_dir)
        if self.engine_index is not None:
            self.engine = _start_engine(cfg, me, run_dir, wiring.address, wiring.placed)
            wiring.clock.mark("engine spawn")
        self.node_rank = None  # node rank k > 0 of a multi-node engine: computes, serves no HTTP
        if wiring.placed.engine is not None and wiring.placed.engine.node_rank > 0:
            self.node_rank = _start_engine(cfg, me, run_dir, wiring.address, wiring.placed,
                                           wiring.dist_init)  # fmt: skip
        if self.engine is None or not wiring.parks_first:
            self.replica, self.version = _build_replica(cfg, wiring, me, run_dir)

    @property
    def flat(self) -> Any:
        return snapshot_buffer(self.replica, self.wiring.residency)

    def serve(self, link: Any, transport: Any) -> int:
        from gyre.runtime.cell.follower import CellFollower
        from gyre.runtime.cell.serving import CellEngine
        from gyre.runtime.cell.trainer import CellTrainer

        trainer = CellTrainer(self.cfg, self.replica, self.wiring.comms, transport,
                              version=self.version, run_dir=self.run_dir,
                              residency=self.wiring.residency)  # fmt: skip
        served = None
        if self.engine is not None and self.engine_index is not None:
            served = CellEngine(self.cfg, index=self.engine_index, engine=self.engine,
                                run_dir=self.run_dir,
                                up=lambda m: link.send(m, COORDINATOR_RANK))  # fmt: skip
        self.wiring.report_startup(self.me)
        try:
            return CellFollower(trainer, served, self.cfg.engines_per_cell,
                                host=self.wiring.address).serve(link)  # fmt: skip
        finally:
            if self.node_rank is not None:  # node rank 0's shutdown stops it first
                self.node_rank.stop()


class JudgeRole:
    """A judge engine: the run's model at its initial weights, serving the `judge` scoring
    rule at the proxy node's evaluator (`SetJudges`). No replica, no snapshot, no publish:
    the coordinator knows it only by its URL and tells it to stop."""

    flat = None

    def __init__(self, cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> None:
        import gyre.runtime.cell.engine_host  # noqa: F401  (torch)

        self.cfg, self.wiring, self.me = cfg, wiring, me
        wiring.clock.mark("role imports")
        self.engine = _start_engine(cfg, me, run_dir, wiring.address, wiring.placed)
        wiring.clock.mark("engine spawn")

    def serve(self, link: Any, transport: Any) -> int:
        """Serve until `Stop`; an engine that dies (killed, OOM) is started again and its
        new URL reported (`JudgeReady` once more): meanwhile verdicts fail and are retried,
        never scored."""
        from gyre.runtime.shared import messages as msg

        url = self.engine.wait_ready(self.cfg.timeouts.startup_s)
        self.wiring.clock.mark("engine ready")
        self.wiring.report_startup(self.me)
        link.send(msg.JudgeReady(self.me.index, url), COORDINATOR_RANK)
        try:
            while not isinstance(m := link.recv(timeout=1.0), msg.Stop):
                if m is not None:  # nothing else is ever sent to a judge engine
                    raise AssertionError(f"judge engine {self.me.index}: got {m!r:.200}")
                if not self.engine.alive():
                    self.engine.spawn()
                    url = self.engine.wait_ready(self.cfg.timeouts.startup_s)
                    link.send(msg.JudgeReady(self.me.index, url), COORDINATOR_RANK)
        finally:
            self.engine.stop()
        return m.status


def shards(cfg: RunConfig) -> tuple[int, ...]:
    """The ranks of each cell that host its engines (`engine_shards`)."""
    return engine_shards(cfg.engines_per_cell, cfg.engine_ranks)


def _role(cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> RankRole:
    """A cell rank: the leader hosts the cell's first engine, the others follow it."""
    if me.kind == "cell" and me.shard > 0:
        return FollowerRole(cfg, wiring, me, run_dir)
    return EngineRole(cfg, wiring, me, run_dir)


ROLES: dict[str, Callable[[RunConfig, Wiring, Component, Path], RankRole]] = {
    "coordinator": CoordinatorRole, "proxy": ProxyRole, "cell": _role, "standalone": EngineRole,
    "judge": JudgeRole,
}  # fmt: skip
"""Each component kind's role, built from the run config and the rank's wiring."""


def _build_replica(cfg: RunConfig, wiring: Wiring, me: Component, run_dir: Path) -> tuple[Any, int]:
    """This cell rank's training replica (its shard of the cell, built by the training
    backend) and the version it resumed at (the newest checkpoint's; 0 without one).

    A trainer that shares its GPU with the engine is parked on the host right away (cells
    start in rollout); with `wiring.parks_first` every rank of the cell then waits for the
    others, so the leader starts the engine only once the cell's GPUs are free."""
    import torch

    from gyre.runtime.shared.checkpoint import latest
    from gyre.train.comm import arrive

    torch.set_num_threads(1)
    trainer = cfg.train_backend
    on_gpu = cfg.train.device.startswith("cuda")
    wiring.clock.mark("role imports")  # torch, the training code
    replica = trainer.build(cfg.model, cfg.train, cfg.dims,
                            core=me.index == 0 and trainer.owns_optimizer(me.shard, cfg.dims),
                            device=wiring.placed.device if on_gpu else "cpu",
                            comms=wiring.comms, host=wiring.address)  # fmt: skip
    wiring.clock.mark("model build")
    found = latest(run_dir)
    version = replica.restore(found[0]) if found is not None else 0
    wiring.clock.mark("restore")
    if wiring.residency is not None:
        wiring.residency.release(replica.cell, replica.optimizer)
    if wiring.parks_first:
        arrive(wiring.comms.cell)
        wiring.clock.mark("park")
    return replica, version


def snapshot_buffer(replica: Any, residency: TrainerResidency | None) -> Any:
    """What the snapshot transport (`gyre.train.transfer`) is built over: a trainer's flat
    parameters where they stay put (on the CPU the transport exposes that buffer itself),
    else only their shape and dtype (a meta tensor: the transport keeps a host mirror of
    its own, so a trainer that leaves its GPU leaves no buffer behind). None without one."""
    if replica is None:
        return None
    flat = replica.cell.flat_params
    return flat if residency is None else flat.new_empty(flat.shape, device="meta")


def label(me: Component) -> str:
    """A rank's name in the start-up table: proxy, cell0 (a leader), cell0.1, standalone0."""
    if me.kind == "cell":
        return f"cell{me.index}" + (f".{me.shard}" if me.shard else "")
    return me.kind if me.kind in ("coordinator", "proxy") else f"{me.kind}{me.index}"


def place_rank(cfg: RunConfig, world: Any, components: list[Component]) -> RankDevice:
    """This rank's device and its engine's GPUs (`gyre.runtime.shared.placement`; the CUDA device
    bound). A run that uses no GPU (`train.device: cpu`, embedded engines) plans nothing:
    every rank is on the CPU. Otherwise collective over `world` (the ranks of each node)."""
    from gyre.runtime.shared.placement import RankDevice, node_ranks, plan_node

    me = components[world.Get_rank()]
    if not cfg.uses_gpus:
        return RankDevice(local_rank=0, component=me, device="cpu")
    import torch

    on_node = node_ranks(world, os.environ)
    plan = plan_node(torch.cuda.device_count(), [components[r] for r in on_node],
                     tensor_parallel=cfg.engine.tensor_parallel, mode=cfg.topology.placement,
                     per_cell=cfg.engines_per_cell, nodes=cfg.engine.nodes)  # fmt: skip
    mine = plan[on_node.index(world.Get_rank())]
    if mine.device.startswith("cuda"):
        torch.cuda.set_device(mine.device)
    return mine


def rendezvous(
    cfg: RunConfig, world: Any, components: list[Component], address: str, placed: RankDevice
) -> str:
    """SGLang's --dist-init-addr of the multi-node engine (`engine.nodes` > 1) whose node rank
    this rank launches: node rank 0's host offers `address:free port`, every rank learns the
    offers (collective over `world`) and takes its engine's. Empty on one node."""
    from gyre.rollout.serving.process import free_port

    if cfg.engine.nodes == 1:
        return ""
    me, e = components[world.Get_rank()], placed.engine
    launches = me.kind == "cell" and e is not None
    first = e is not None and launches and e.node_rank == 0
    offered = world.allgather(f"{address}:{free_port(address)}" if first else None)
    if not launches or e is None:
        return ""
    shard = me.shard - e.node_rank * cfg.engine.tensor_parallel
    return str(offered[components.index(Component("cell", me.index, shard))])


def _start_engine(
    cfg: RunConfig, me: Component, run_dir: Path, address: str, placed: RankDevice,
    dist_init: str = "",
) -> Any:  # fmt: skip
    """Spawn this rank's engine (or its node rank of a multi-node engine, meeting the others
    at `dist_init`), bound to (and reached at) this rank's `address`, on the GPUs its
    placement gives it."""
    from gyre.runtime.cell.engine_host import EngineHost

    t, e = cfg.topology, cfg.engines_per_cell
    index = {"cell": 0, "standalone": t.cells * e,
             "judge": t.cells * e + t.standalone_engines}[me.kind] + me.index  # fmt: skip
    name = f"engine-{me.kind}{me.index}"
    node_rank = placed.engine.node_rank if placed.engine else 0
    if me.kind == "cell":  # a cell's engine j: id cell x E + j; the first keeps the cell's name
        j = placed.engine.engine if placed.engine else shards(cfg).index(me.shard)
        index = me.index * e + j
        name += (f"-{j}" if j else "") + (f".node{node_rank}" if node_rank else "")
    labels = {"GYRE_RUN_DIR": str(run_dir.resolve()), "GYRE_ENGINE_INDEX": str(index)}
    concurrency = cfg.schedule.concurrency_per_cell // (e if me.kind == "cell" else 1)
    pace = cfg.pace.engine(concurrency) if cfg.pace.enabled else None
    routed = me.kind != "judge" and cfg.engine.backend == "sglang" and cfg.routing_top_k() > 0
    engine = EngineHost(cfg.model, cfg.engine, run_dir / "logs" / f"{name}.log", version=0,
                        labels=labels, pace=pace, host=address,
                        base_gpu_id=placed.engine.base_gpu_id if placed.engine else 0,
                        routed_experts=routed, node_rank=node_rank,
                        dist_init_addr=dist_init)  # fmt: skip
    engine.spawn()
    return engine
