"""Per-rank entry point of a Gyre job: `python -m gyre.runtime.main CONFIG [options]`.

Started once per rank by `mpiexec -n W` (one machine, `gyre run`) or `srun --het-group=...`
(Slurm). Every rank parses the same config, finds its component from its world rank
(`gyre.runtime.shared.layout`), then builds, serves and closes it (`run_component`): its wiring
(communicators, address, control link, device), its role (`gyre.runtime.roles`), the core →
satellite snapshot transport; the role serves until the run ends:

    rank 0: Coordinator   rank 1: ProxyNode   ranks 2..: cells (R ranks each: CellProcess
    on the leader, which hosts the engine, CellFollower on the others), standalone engines

Each rank times its start-up phases from `gyre run`'s start (`gyre.runtime.shared.startup`) and
tells the coordinator once it serves: the summary's `startup`, `gyre run --profile-startup`.
Any failure prints one line naming the rank and component and aborts the whole world, so a
job never hangs on a dead peer. Exit status 0 after `steps` updates.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.rollout.protocol import ensure_engine_key
from gyre.runtime.shared.config import RunConfig, dump_run_config, load_run_config
from gyre.runtime.shared.layout import (
    Component,
    cell_members,
    hosts_engine,
    layout,
)
from gyre.runtime.shared.startup import StartupClock


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
    clock = StartupClock()  # from `gyre run`'s start: its phases until this rank serves
    from mpi4py import MPI

    from gyre.runtime.shared import wire

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    component: Component | None = None
    clock.mark("imports")  # the interpreter, this module's imports, MPI_Init
    try:
        args = parse(argv)
        cfg = load_run_config(args.config, steps=args.steps, policy=args.policy)
        components = layout(world.Get_size(), cfg.topology)
        component = components[rank]
        clock.mark("config")
        if fork_engine_zygote(cfg, component):  # before any other thread of ours starts
            clock.mark("zygote")
        _debug(f"rank {rank} is {component} (pid {os.getpid()})")
        run_dir = Path(args.run_dir) if args.run_dir else None
        from gyre.train.comm import arrive  # barriers that sleep instead of spinning a core

        arrive(world)
        run_dir = Path(world.bcast(str(run_dir or default_run_dir(cfg)), root=0))
        # one engine key for the run: every rank's engines and engine clients use it
        ensure_engine_key(world.bcast(secrets.token_hex(16) if rank == 0 else None, root=0))
        keep = None  # rank 0, continuing a run under another config: config.yaml, later
        if rank == 0:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            keep = keep_config(run_dir / "config.yaml", dump_run_config(cfg))
        _install_signals(rank)
        arrive(world)
        clock.mark("rendezvous")  # every rank started: the world's first collectives
        status = run_component(cfg, world, components, component, run_dir, clock, keep)
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


def fork_engine_zygote(cfg: RunConfig, me: Component) -> bool:
    """A rank that hosts an embedded engine imports what the engine needs and forks its
    engine zygote (`gyre.zygote`): its engines are then forked from it rather
    than started as new interpreters that import torch and transformers again. Done right
    after MPI_Init, while the rank has no thread of its own: the zygote holds no lock another
    thread took, and never calls MPI (MPICH and Open MPI allow a child that does not). Only
    for the embedded engine on the CPU (`EngineProcess.spawn`); `engine.zygote: false` starts
    none. Returns whether it started one."""
    from gyre.runtime.roles import shards

    if not (cfg.engine.embedded_on_cpu and cfg.engine.zygote and hosts_engine(me, shards(cfg))):
        return False
    from gyre import zygote
    from gyre.rollout import server

    zygote.start(server.preload)
    return True


def preload(backend: str) -> None:
    """Import what the ranks of a run with training backend `backend` import, once, in `gyre
    run`'s rank zygote (`gyre.zygote`): mpiexec's ranks are then forked from it rather than
    each importing torch, transformers, tornado, h5py (and megatron-core) as a new
    interpreter. Not MPI itself: each rank initialises its own, after the fork."""
    import importlib

    modules = ["gyre.runtime.roles", "gyre.runtime.coordinator.coordinator",
               "gyre.runtime.proxy_node.node", "gyre.runtime.cell.engine_host",
               "gyre.runtime.cell.leader", "gyre.runtime.cell.follower",
               "gyre.runtime.shared.wire", "gyre.train.comm", "gyre.train.transfer"]  # fmt: skip
    if backend == "megatron":
        from gyre.train.megatron.model import import_megatron

        import_megatron()  # before any megatron module: as a Megatron rank imports it
        modules += ["torch.distributed", "megatron.core.parallel_state",
                    "gyre.train.megatron.model", "gyre.train.megatron.weights",
                    "gyre.train.megatron.shard_files"]  # fmt: skip
    for module in modules:
        importlib.import_module(module)
    from gyre.rollout import server

    server.preload()
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("the rank zygote imported mpi4py.MPI: its ranks could not start MPI")


def forks_ranks(cfg: RunConfig) -> bool:
    """Whether `gyre run` forks this config's ranks from a rank zygote: `topology.zygote`,
    and nothing of the run on a GPU (CUDA does not survive a fork)."""
    trains_on_gpu = cfg.train.device.startswith("cuda")
    return cfg.topology.zygote and cfg.engine.embedded_on_cpu and not trains_on_gpu


RESUME_CONFIG = "config.resume.yaml"
"""Where `gyre run` writes the merged config of a run it continues (`ranks_config`)."""


def ranks_config(run_dir: Path, text: str) -> Path:
    """The file `gyre run` writes `text`, the merged config, to for every rank to read: the
    run directory's config.yaml for a new run (or one that already holds `text`); for a run
    already there under another config (`--resume` with overrides), `config.resume.yaml`
    beside it, so the run's own config.yaml is replaced only by a resume that starts
    (`keep_config`)."""
    own = run_dir / "config.yaml"
    with contextlib.suppress(OSError):
        if own.read_text() != text:
            return run_dir / RESUME_CONFIG
    return own


def keep_config(path: Path, text: str) -> Callable[[], None] | None:
    """Rank 0: the run directory's config.yaml holds `text`, the config every rank runs
    (the trace's run meta copies this file).

    Under `gyre run` a new run's file is the one every rank read, already merged and
    written: kept as it is. A job started from another file (sbatch, submitit, a requeue) or
    with `--steps` / `--policy` gets it written, atomically: other ranks may be reading the
    file it replaces. A run continued under another config (its trace exists) keeps its own
    config.yaml until every rank has started: returned is the write, for then, so a resume
    that fails to start never replaces it.
    """
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return None

    def write() -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    if path.exists() and (path.parent / "trace.h5").exists():
        return write
    write()
    return None


def _install_signals(rank: int) -> None:
    """SIGUSR1 (Slurm's warning before the time limit): the coordinator checkpoints."""
    import signal

    from gyre.runtime.shared.checkpoint import PREEMPT

    if rank == 0:
        signal.signal(signal.SIGUSR1, lambda *_: PREEMPT.set())
    else:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


PMI_ACK_S = 10.0
"""Seconds a rank waits for mpiexec's answer to its PMI finalize (`exit_process`)."""


def exit_process(status: int) -> None:
    """Leave the process with `status` once every rank passed the final barrier: tell
    `mpiexec` this rank finished (`pmi_finalize`), then leave at once (os._exit), without
    MPI_Finalize, Python's interpreter shutdown or the C library's exit handlers.

    Telling it matters: `mpiexec` (MPICH's hydra) takes a rank that leaves without a PMI
    finalize for a failed one and SIGKILLs every rank still running; the job then exits 9
    whenever one of them had not yet left (under load, finished runs failed so). MPICH sends
    it from a C exit handler, which os._exit skips. What is skipped is skipped on purpose:
    the interpreter's shutdown waits on threads that may still block in MPI, the mpich
    wheel's MPI_Finalize was seen spinning after threaded use, and exit() runs C++ static
    destructors that abort while gloo's threads live ("terminate called without an active
    exception", tests/gpu/test_gpu_serving.py).
    """
    from gyre import zygote

    zygote.close()  # reaped here: its engines' CPU time counts as this rank's children's
    sys.stdout.flush()
    sys.stderr.flush()
    pmi_finalize()
    os._exit(status)


def pmi_finalize(timeout: float = PMI_ACK_S) -> bool:
    """Send the PMI-1 finalize on the socket hydra handed this rank (`PMI_FD`) and wait for
    its acknowledgement, as MPICH's own exit handler does; True once acknowledged. Only under
    hydra (which also sets `MPI_LOCALRANKID`): srun's PMI-2 / PMIx server speaks another
    wire format and does not kill a rank's peers when it leaves without a finalize."""
    import select

    text = os.environ.get("PMI_FD", "")
    if not text.isdigit() or "MPI_LOCALRANKID" not in os.environ:
        return False
    fd = int(text)
    try:
        os.write(fd, b"cmd=finalize\n")
        answer, end = b"", time.monotonic() + timeout
        while (
            not answer.endswith(b"\n")
            and select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]
        ):
            chunk = os.read(fd, 256)
            if not chunk:
                break
            answer += chunk
    except OSError:
        return False
    return answer.startswith(b"cmd=finalize_ack")


def run_component(
    cfg: RunConfig, world: Any, components: list[Component], me: Component, run_dir: Path,
    clock: StartupClock | None = None, started: Callable[[], None] | None = None,
) -> int:  # fmt: skip
    """Build this rank's wiring and its role, serve the role, close: its exit status (0,
    or EXIT_CHECKPOINTED). `clock` times the start-up phases (`gyre.runtime.shared.startup`);
    `started` runs once every rank has built its role (`keep_config`'s deferred write)."""
    from gyre.runtime.roles import ROLES, Wiring
    from gyre.train.transfer import make_transport

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wiring = Wiring.connect(cfg, world, components, clock or StartupClock())
    role = ROLES[me.kind](cfg, wiring, me, run_dir)  # its component, built
    transport = make_transport(  # collective: the core -> satellite snapshot transport
        cfg.train.transport, world, core_ranks=cell_members(components)[0], shard=me.shard,
        flat=role.flat, host=wiring.address,
    )  # fmt: skip
    wiring.clock.mark("transport")  # collective: waits for the slowest rank's role
    if started is not None:  # every rank built its role: the run has taken over
        started()
    status = role.serve(wiring.link, transport)
    _debug(f"{me.kind} {me.index} stopped")
    transport.close()  # collective: every rank gets here once its role stopped
    wiring.link.close()
    return status


def _debug(text: str) -> None:
    """With GYRE_DEBUG=1: timestamped lifecycle lines on stderr, stacks on SIGUSR2."""
    if os.environ.get("GYRE_DEBUG"):
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR2, all_threads=True)
        print(f"[{time.time():.1f}] {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    exit_process(main())
