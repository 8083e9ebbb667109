"""A tiny stand-in for the runtime that exercises the Slurm machinery end to end.

Same command line as `gyre.runtime.main` (`CONFIG --run-dir D [--steps S]`), so the sbatch
script runs it with `GYRE_ENTRY=gyre.launch.probe`. Every rank derives its component from
`SLURM_PROCID` and the `SLURM_NTASKS_HET_GROUP_<n>` totals (or from its MPI rank outside
Slurm), checks it against the config's layout and an MPI allreduce across the world; rank 0
writes `D/probe.json`. Then S tiny "steps" run with the runtime's preemption contract: rank 0
checkpoints after every step (`D/probe-checkpoint.json`, the step log `D/probe-steps.jsonl`),
and on SIGUSR1 (or SIGTERM) it stops the world at the next step boundary and exits with
`EXIT_CHECKPOINTED`; a restarted job resumes at the next step.

    GYRE_ENTRY=gyre.launch.probe sbatch slurm/gyre.sbatch templates/local.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gyre.launch.spec import JobSpec, job_spec, load_launch
from gyre.launch.task import (
    EXIT_CHECKPOINTED,
    het_group_sizes,
    locate,
    restart_count,
)
from gyre.runtime.shared.layout import Component, Layout


def expected_components(spec: JobSpec) -> list[tuple[str, int, int]]:
    """(role, index, shard) of every world rank, in rank order, from the config alone."""
    return [(c.kind, c.index, c.shard) for c in Layout(spec.launch.topology).components]


def identify(rank: int, spec: JobSpec, env: dict[str, str]) -> dict[str, Any]:
    """This rank's component, as Slurm's environment says and as the config says."""
    expected = expected_components(spec)[rank]
    record: dict[str, Any] = {
        "rank": rank,
        "host": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "expected": list(expected),
    }
    sizes = het_group_sizes(env)
    if sizes is not None and "SLURM_PROCID" in env:
        procid = int(env["SLURM_PROCID"])
        group, in_group = locate(procid, sizes)
        record.update(
            procid=procid,
            het_group=group,
            rank_in_group=in_group,
            slurm=list(_fields(Layout(spec.launch.topology).component_at(group, in_group))),
        )
    return record


def _fields(c: Component) -> tuple[str, int, int]:
    return c.kind, c.index, c.shard


class _StopFlag:
    """Set by SIGUSR1 / SIGTERM on rank 0."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.signal = signal.Signals(signum).name


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    flag = _StopFlag()
    if rank == 0:
        signal.signal(signal.SIGUSR1, flag)
        signal.signal(signal.SIGTERM, flag)
    else:  # only the coordinator acts on preemption; the others follow its stop
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    launch = load_launch(args.config)
    spec = job_spec(launch)
    run_dir = Path(args.run_dir)
    record = identify(rank, spec, dict(os.environ)) if size == spec.world_size else {"rank": rank}
    total = comm.allreduce(rank)
    records = comm.gather(record, root=0)
    ok = size == spec.world_size and total == size * (size - 1) // 2
    if rank == 0:
        assert records is not None
        ok = ok and all(_consistent(r) for r in records)
        _write_json(run_dir / "probe.json", _summary(size, spec, records, total, ok))
        print(f"[probe] world {size} ranks, allreduce {total}, layout ok={ok}", flush=True)
    ok = comm.bcast(ok, root=0)
    if not ok:
        return 3
    steps = args.steps if args.steps is not None else _config_steps(args.config)
    return _steps(comm, run_dir, steps, args.step_seconds, flag)


def _consistent(r: dict[str, Any]) -> bool:
    if "slurm" not in r:
        return "expected" in r
    return bool(r["slurm"] == r["expected"] and r["procid"] == r["rank"])


def _summary(
    size: int, spec: JobSpec, records: list[dict[str, Any]], total: int, ok: bool
) -> dict[str, Any]:
    return {
        "world_size": size,
        "expected_world_size": spec.world_size,
        "allreduce": total,
        "ok": ok,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart_count": restart_count(os.environ),
        "ranks": records,
    }


def _work(comm: Any, seconds: float) -> None:
    """A step's work: `seconds` of sleep that keeps this rank's MPI progressing. A netmod
    without asynchronous progress (MPICH's OFI over tcp, across nodes) moves a rank's queued
    messages only while it is inside MPI: a plain sleep right after the broadcast held the
    others in it for the root's sleep (a 0.5 s step took 1.5 s under Slurm)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        comm.Iprobe()
        time.sleep(min(left, 0.01))


def _steps(comm: Any, run_dir: Path, steps: int, pause: float, flag: _StopFlag) -> int:
    ckpt = run_dir / "probe-checkpoint.json"
    start = 0
    if comm.Get_rank() == 0 and ckpt.exists():
        start = int(json.loads(ckpt.read_text())["step"])
        print(f"[probe] resuming after step {start}", flush=True)
    start = comm.bcast(start, root=0)
    for step in range(start + 1, steps + 1):
        stop = comm.bcast(flag.signal, root=0)
        if stop:
            if comm.Get_rank() == 0:
                _write_json(ckpt, {"step": step - 1, "reason": stop})
                print(f"[probe] {stop}: checkpointed after step {step - 1}", flush=True)
            comm.Barrier()
            return EXIT_CHECKPOINTED if comm.Get_rank() == 0 else 0
        _work(comm, pause)
        comm.allreduce(step)
        if comm.Get_rank() == 0:
            _append_step(run_dir, step)
            _write_json(ckpt, {"step": step, "reason": "step"})
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"[probe] finished {steps} steps", flush=True)
    return 0


def _append_step(run_dir: Path, step: int) -> None:
    line = {"step": step, "restart": restart_count(os.environ), "time": time.time()}
    with open(run_dir / "probe-steps.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _config_steps(config: str) -> int:
    import yaml

    data = yaml.safe_load(Path(config).read_text()) or {}
    return int(data.get("steps", 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.launch.probe", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=float(os.environ.get("GYRE_PROBE_STEP_SECONDS", "0.2")),
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
