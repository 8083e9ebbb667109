"""Training-plane benchmark: micro-step throughput, snapshot pulls and the J_max effect.

    python tools/bench_training.py [--json] [--quick]

Reports
* the training throughput (target tokens/s) of real `gyre run` jobs with 1, 2 and 3 cells
  fixed in training (the runtime's own batch protocol, docs/training.md);
* weight-snapshot pull time core -> satellite for a ~100 MB buffer, Mooncake TCP vs MPI;
* target tokens, row tokens and forward-backward time with J_max = 1, 5 and unlimited on
  synthetic branching executions, as fractions of the uncapped case (the paper reports
  41.4 % and 74.8 % of uncapped forward-backward time for caps 1 and 5).

The MPI parts re-invoke this file under the `mpich` wheel's mpiexec (`--child ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")


def mpiexec() -> str:
    """The mpiexec of the `mpich` wheel (bin/ next to this Python), else the one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def _world(n: int, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [mpiexec(), "-n", str(n), sys.executable, __file__, "--child", *args, str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def bench_throughput(cells: int, quick: bool) -> dict:
    """Target tokens per second of the batches of a real `gyre run` with `cells` training cells.

    The run is the local job on a training-heavy model (tiny:256x4), Async with `cells`
    cells fixed in training and rollout on the others plus one standalone engine, so the
    training prefix is the same in every batch; each batch's work is `train_wall_s`, from its
    first pass to its finished update (the first batch, which pays start-up, is left out).
    """
    import yaml

    from gyre.trajectory.reader import TraceReader

    cfg = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    cfg["model"] = "tiny:256x4"
    cfg["steps"] = 3 if quick else 5
    cfg["topology"].update({"cells": 3, "standalone_engines": 1})
    cfg["schedule"].update({"policy": "async", "train_cells": cells, "phi": 1.0})
    cfg["train"]["token_budget"] = 2048  # several micro-steps per batch: work to share
    with tempfile.TemporaryDirectory() as tmp:
        cfg["runs_dir"] = tmp
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "gyre", "run", str(path), "--run-dir", str(run_dir), "--quiet"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        with TraceReader(run_dir / "trace.h5") as r:
            rows = r.rows("steps")
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {})[row["name"]] = float(row["value"])
    later = [v for k, v in sorted(by_step.items()) if k > 1]
    tokens = sum(v["targets"] for v in later)
    wall = sum(v["train_wall_s"] for v in later)
    return {"target_tokens_per_s": tokens / wall, "batches": len(later),
            "train_wall_s_per_batch": wall / len(later)}  # fmt: skip


def child_pull(out: Path) -> None:
    """MPI program (3 ranks): pull a 100 MB snapshot with each transport; rank 2 reports."""
    import torch
    from mpi4py import MPI

    from gyre.train.transfer import make_transport

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    flat = torch.arange(25_000_000, dtype=torch.float32) if rank == 1 else torch.zeros(25_000_000)
    result = {}
    for kind in ("mooncake", "mpi"):
        try:
            tr = make_transport(
                kind, world, core_ranks=[1], shard=0, flat=flat if rank > 0 else None
            )
        except Exception as e:  # report instead of failing the whole benchmark
            result[kind] = f"unavailable: {e}"
            continue
        world.Barrier()
        if rank == 2:
            times = [tr.pull(flat) for _ in range(5)]
            assert float(flat[-1]) == float(np.float32(24_999_999)), "snapshot content differs"
            result[kind] = float(np.median(times))
            flat.zero_()
        world.Barrier()
        tr.close()
    if rank == 2:
        out.write_text(json.dumps({"snapshot_bytes": 100_000_000, "pull_seconds": result}))


def bench_jmax(quick: bool) -> dict:
    """Tokens and forward-backward time with J_max = 1, 5, unlimited (one process)."""
    import torch

    from gyre.train.admission import AdmissionConfig, AdmissionTree, admit
    from gyre.train.cell import TorchCell
    from gyre.train.objective import ObjectiveConfig, execution_scalars, merge_sums
    from gyre.train.packing import materialize_execution, pack_rows
    from gyre.train.synthetic import TinyCausalLM, branching_tree

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    trees = [
        branching_tree(
            rng,
            f"e{i}",
            vocab=2048,
            subagents=3,
            turns=10,
            subagent_turns=4,
            compactions=2,
            scale=10,
        )
        for i in range(6 if quick else 12)
    ]
    cell = TorchCell(TinyCausalLM(vocab=2048, dim=128), objective=ObjectiveConfig())
    out: dict = {}
    for name, j in (("1", 1), ("5", 5), ("unlimited", None)):
        rows = []
        for t in trees:
            picked = admit(AdmissionTree.from_tree(t), config=AdmissionConfig(j_max=j), seed=0)
            rows += materialize_execution(t, picked, advantage=1.0, group_id="g", policy_version=0)
        steps = pack_rows(rows, token_budget=4096)
        info = {r.execution_id: (r.advantage, r.execution_targets) for r in rows}
        t0 = time.perf_counter()
        sc = execution_scalars(merge_sums([cell.prepass(s) for s in steps]), info, cell.objective)
        for s in steps:
            cell.accumulate(s, sc)
        out[name] = {
            "trajectories": len(rows),
            "target_tokens": sum(r.num_targets for r in rows),
            "row_tokens": sum(r.length for r in rows),
            "fwd_bwd_seconds": time.perf_counter() - t0,
        }
    base = out["unlimited"]
    for v in out.values():
        v["row_tokens_frac"] = v["row_tokens"] / base["row_tokens"]
        v["fwd_bwd_frac"] = v["fwd_bwd_seconds"] / base["fwd_bwd_seconds"]
    return out


def run_child(argv: list[str]) -> int:
    """One rank of a benchmark world; any error aborts the whole world instead of hanging it."""
    from mpi4py import MPI

    _kind, *rest = argv  # "pull": the one MPI child
    try:
        child_pull(Path(rest[0]))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="smaller batches (CI smoke run)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args.child)
    report = {
        "throughput": {k: bench_throughput(k, args.quick) for k in (1, 2, 3)},
        "snapshot": _world(3, ["pull"]),
        "j_max": bench_jmax(args.quick),
        "machine": f"{os.cpu_count()} CPUs, one rank per cell, OMP_NUM_THREADS=1",
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for k, v in report["throughput"].items():
        print(f"cells={k}: {v['target_tokens_per_s']:.0f} target tokens/s")
    for kind, v in report["snapshot"]["pull_seconds"].items():
        print(f"snapshot pull 100 MB via {kind}: " + (f"{v:.3f} s" if isinstance(v, float) else v))
    for name, v in report["j_max"].items():
        print(
            f"J_max={name}: {v['trajectories']} trajectories, {v['target_tokens']} targets, "
            f"{v['row_tokens']} row tokens ({v['row_tokens_frac']:.1%}), "
            f"fwd-bwd {v['fwd_bwd_seconds']:.2f} s ({v['fwd_bwd_frac']:.1%} of unlimited)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
