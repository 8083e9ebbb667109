"""Per-rank entry point of a Gyre job: `python -m gyre.runtime.main CONFIG [options]`.

Started once per rank by `mpiexec -n W` (one machine, `gyre run`) or `srun --het-group=...`
(Slurm). Every rank reads the same config, finds its component from its world rank
(`gyre.runtime.layout`), builds the communicators once (per-cell `Split` and the K-1 prefix
sets) and the core → satellite snapshot transport, then runs its component:

    rank 0: Coordinator   rank 1: ProxyNode   ranks 2..: cells (R ranks each: CellProcess
    on the leader, which hosts the engine, CellFollower on the others), standalone engines

Any failure prints one line naming the rank and component and aborts the whole world, so a
job never hangs on a dead peer. Exit status 0 after `steps` updates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gyre.rollout.protocol import ensure_engine_key
from gyre.runtime.config import RunConfig, dump_run_config, load_run_config
from gyre.runtime.layout import (
    Component,
    cell_members,
    cell_of_rank,
    engine_ranks,
    layout,
)
from gyre.runtime.placement import RankDevice
from gyre.runtime.residency import TrainerResidency


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.runtime.main")
    p.add_argument("config", help="run YAML (templates/local.yaml)")
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<name>-<time>)")
    p.add_argument("--steps", type=int, default=None, help="optimizer updates (overrides config)")
    p.add_argument("--policy", default=None, help="elastic | async | colocate (overrides config)")
    return p.parse_args(argv)


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.runs_dir) / f"{cfg.name}-{cfg.schedule.policy}-{stamp}"


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from gyre.runtime import wire

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    component: Component | None = None
    try:
        args = parse(argv)
        cfg = load_run_config(args.config, steps=args.steps, policy=args.policy)
        components = layout(world.Get_size(), cfg.topology)
        component = components[rank]
        _debug(f"rank {rank} is {component} (pid {os.getpid()})")
        run_dir = Path(args.run_dir) if args.run_dir else None
        from gyre.train.comm import arrive  # barriers that sleep instead of spinning a core

        arrive(world)
        run_dir = Path(world.bcast(str(run_dir or default_run_dir(cfg)), root=0))
        # one engine key for the run: every rank's engines and engine clients use it
        ensure_engine_key(world.bcast(secrets.token_hex(16) if rank == 0 else None, root=0))
        if rank == 0:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            keep_config(run_dir / "config.yaml", dump_run_config(cfg))
        _install_signals(rank)
        arrive(world)
        status = run_component(cfg, world, components, component, run_dir)
        _debug(f"rank {rank} finished its component (status {status})")
        arrive(world)  # ranks finish at different times (the coordinator writes the policy)
        # then a blocking barrier, which every rank now enters at once: a rank leaves (without
        # MPI_Finalize) only when no peer still needs a message from it to finish the barrier
        world.Barrier()
    except BaseException as e:  # one boundary: a message, then abort the world
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        wire.abort_world(rank, component.kind if component else "startup", e)
        return 1
    return status


def keep_config(path: Path, text: str) -> None:
    """Rank 0: the run directory's config.yaml holds `text`, the config every rank runs
    (the trace's run meta copies this file).

    Under `gyre run` it is the file every rank read, already merged and written: kept as it
    is. A job started from another file (sbatch, submitit, a requeue) or with `--steps` /
    `--policy` gets it written, atomically: other ranks may be reading the file it replaces.
    """
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _install_signals(rank: int) -> None:
    """SIGUSR1 (Slurm's warning before the time limit): the coordinator checkpoints."""
    import signal

    from gyre.runtime.checkpoint import PREEMPT

    if rank == 0:
        signal.signal(signal.SIGUSR1, lambda *_: PREEMPT.set())
    else:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def exit_without_finalize(status: int) -> None:
    """Leave the process after every rank passed the final barrier, skipping MPI_Finalize.

    The mpich wheel's Finalize was seen spinning forever after threaded use (every rank past
    its work, busy in Finalize); the work is done and the trace closed, so exit directly.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_component(
    cfg: RunConfig, world: Any, components: list[Component], me: Component, run_dir: Path
) -> int:
    """Run this rank's component; returns its exit status (0, or EXIT_CHECKPOINTED)."""
    from gyre.train.comm import build_communicators
    from gyre.train.transfer import make_transport

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gyre.runtime import wire
    from gyre.runtime.address import node_address

    comms = build_communicators(world, cell_of_rank=cell_of_rank(components))
    # how other ranks reach this one: its engine's URL, the control port, snapshot peers
    address = node_address(world)
    link = wire.connect(world, address)  # the control channel (MPI stays for collectives)
    # where every rank runs: its Slurm node (else host), for the trace and the summary
    hosts = world.allgather(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    from gyre.runtime.checkpoint import latest

    placed = place_rank(cfg, world, components)  # this rank's device, its engine's GPUs
    on_gpu = cfg.train.device.startswith("cuda")  # else the trainer stays on the CPU
    residency = TrainerResidency.for_rank(placed) if on_gpu else None
    replica = engine = None
    version = 0
    if me.kind == "standalone" or (me.kind == "cell" and me.shard == 0):
        engine = _start_engine(cfg, me, run_dir, address, placed)  # the cell's leader hosts it
    if me.kind == "cell":
        import torch

        from gyre.runtime.replica import build_replica

        torch.set_num_threads(1)
        owns_optimizer = me.index == 0 and (me.shard == 0 or cfg.train.backend == "megatron")
        replica = build_replica(cfg, core=owns_optimizer, comms=comms, host=address,
                                device=placed.device if on_gpu else "cpu")  # fmt: skip
        version = replica.restore(run_dir, me.shard)
    elif me.kind == "standalone" and (found := latest(run_dir)) is not None:
        version = int(found[1]["version"])
    flat = replica.cell.flat_params if replica is not None else None
    transport = make_transport(
        cfg.train.transport, world, core_ranks=cell_members(components)[0], shard=me.shard,
        flat=flat, host=address,
    )  # fmt: skip
    if me.kind == "coordinator":
        status = _run_coordinator(cfg, link, components, run_dir, hosts)
    elif me.kind == "proxy":
        from gyre.runtime.proxy_node import run_proxy_node

        status = run_proxy_node(cfg, link, run_dir)
    elif me.kind == "cell" and me.shard > 0:
        from gyre.runtime.cell_follower import CellFollower
        from gyre.runtime.cell_trainer import CellTrainer

        assert replica is not None
        trainer = CellTrainer(cfg, replica, comms, transport, version=version, run_dir=run_dir,
                              residency=residency)  # fmt: skip
        status = CellFollower(trainer).serve(link)
    else:
        from gyre.runtime.cell import CellProcess

        assert engine is not None
        k = cfg.topology.cells
        index = me.index if me.kind == "cell" else k + me.index
        status = CellProcess(
            cfg, engine_index=index, comms=comms, run_dir=run_dir, engine=engine,
            replica=replica, transport=transport, version=version,
            residency=residency if replica is not None else None,
        ).serve(link)  # fmt: skip
    _debug(f"{me.kind} {me.index} stopped")
    transport.close()  # collective: every rank gets here once its component stopped
    link.close()
    return status


def _debug(text: str) -> None:
    """With GYRE_DEBUG=1: timestamped lifecycle lines on stderr, stacks on SIGUSR2."""
    if os.environ.get("GYRE_DEBUG"):
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR2, all_threads=True)
        print(f"[{time.time():.1f}] {text}", file=sys.stderr, flush=True)


def place_rank(cfg: RunConfig, world: Any, components: list[Component]) -> RankDevice:
    """This rank's device and its engine's GPUs (`gyre.runtime.placement`; the CUDA device
    bound). A run that uses no GPU (`train.device: cpu`, embedded engines) plans nothing:
    every rank is on the CPU. Otherwise collective over `world` (the ranks of each node)."""
    from gyre.runtime.placement import RankDevice, node_ranks, plan_node

    me = components[world.Get_rank()]
    if not (cfg.train.device.startswith("cuda") or cfg.engine.backend == "sglang"):
        return RankDevice(local_rank=0, component=me, device="cpu")
    import torch

    on_node = node_ranks(world, os.environ)
    plan = plan_node(torch.cuda.device_count(), [components[r] for r in on_node],
                     tensor_parallel=cfg.engine.tensor_parallel,
                     mode=cfg.topology.placement)  # fmt: skip
    mine = plan[on_node.index(world.Get_rank())]
    if mine.device.startswith("cuda"):
        torch.cuda.set_device(mine.device)
    return mine


def _start_engine(
    cfg: RunConfig, me: Component, run_dir: Path, address: str, placed: RankDevice
) -> Any:
    """Spawn this rank's engine, bound to (and reached at) this rank's `address`, on the
    GPUs its placement gives it."""
    from gyre.runtime.engine_host import EngineHost

    name = f"engine-cell{me.index}" if me.kind == "cell" else f"engine-standalone{me.index}"
    index = me.index if me.kind == "cell" else cfg.topology.cells + me.index
    labels = {"GYRE_RUN_DIR": str(run_dir.resolve()), "GYRE_ENGINE_INDEX": str(index)}
    pace = cfg.pace.engine(cfg.schedule.concurrency_per_cell) if cfg.pace.enabled else None
    engine = EngineHost(cfg.model, cfg.engine, run_dir / "logs" / f"{name}.log", version=0,
                        labels=labels, pace=pace, host=address,
                        base_gpu_id=placed.engine.base_gpu_id if placed.engine else 0)  # fmt: skip
    engine.spawn()
    return engine


def _run_coordinator(
    cfg: RunConfig, link: Any, components: list[Component], run_dir: Path, hosts: list[str]
) -> int:
    from gyre import provenance
    from gyre.runtime.coordinator import Coordinator

    meta = {"config": (run_dir / "config.yaml").read_text(), "world_size": len(components),
            "hosts": hosts, "model": cfg.model, **provenance()}  # fmt: skip
    coordinator = Coordinator(cfg, link, run_dir, engine_ranks(components), meta,
                              cell_members=cell_members(components))  # fmt: skip
    try:
        summary = coordinator.run()
    finally:  # a failed run still leaves its trackers' files closed
        coordinator.tracker.close()
    print("GYRE-SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "steps"}),
          flush=True)  # fmt: skip
    return int(summary["status"])


if __name__ == "__main__":
    exit_without_finalize(main())
