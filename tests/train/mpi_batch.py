"""An MPI world streaming several batches with satellites joining mid-batch (test driver).

Run: mpiexec -n 4 python tests/train/mpi_batch.py OUT --seed 0 --transport mpi
Rank 0 is the coordinator, ranks 1..K the cells (cell 0 = core). The batch plan (sizes,
micro-step token budgets, satellite join points) derives from the seed, so the test can rebuild
the same batches in one process and compare. The core writes the summed gradient and the
parameters after every update to OUT/core.npz, satellites their final parameters to
OUT/cell<k>.npz, the coordinator the batch reports to OUT/reports.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


VOCAB = 512


def plan(seed: int, num_cells: int) -> list[dict]:
    """Batches: token budget, release chunk, end of burst, and each joining satellite's join
    point as a fraction of the batch's claims (phase A + phase B), in cell order."""
    sats = list(range(1, num_cells))
    member = [[], sats[:1], sats[1:2], sats]  # joins per batch: 1, 2, 3 cells, then re-join
    ends = [False, False, True, True]
    rng = random.Random(seed)
    out = []
    for b in range(4):
        out.append({
            "seed": seed * 1000 + b,
            "executions": 8,
            "token_budget": rng.choice([40, 60, 90, 140]),
            "chunk": rng.choice([1, 2]),
            "end_of_burst": ends[b],
            "joins": {str(c): rng.random() for c in member[b]},
        })  # fmt: skip
    return out


def batch_data(spec: dict):
    """The rows and execution table of one planned batch (same on every process)."""
    from gyre.train.packing import pack_rows
    from gyre.train.synthetic import random_batch

    rows, info = random_batch(
        np.random.default_rng(spec["seed"]), executions=spec["executions"], vocab=VOCAB,
        length=(6, 30), behaviour_noise=0.01,
    )  # fmt: skip
    return pack_rows(rows, token_budget=spec["token_budget"]), info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", choices=["mpi", "mooncake"], default="mpi")
    args = ap.parse_args()

    import torch
    from mpi4py import MPI

    from gyre.train.cell import CoreOptimizer, OptimConfig, TorchCell
    from gyre.train.comm import build_communicators
    from gyre.train.objective import ObjectiveConfig
    from gyre.train.stream import FixedStream
    from gyre.train.transfer import make_transport
    from gyre.train.world import CellWorker, Coordinator

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    k = world.Get_size() - 1
    cell_of_rank = [None, *range(k)]
    comms = build_communicators(world, cell_of_rank=cell_of_rank)
    objective = ObjectiveConfig()
    batches = plan(args.seed, k)
    cell = None
    if comms.cell_id is not None:
        from gyre.train.synthetic import TinyCausalLM

        cell = TorchCell(TinyCausalLM(vocab=VOCAB).double(), objective=objective)
        if comms.cell_id > 0:  # satellites start from garbage: they must pull the snapshot
            cell.flat_params.normal_()
    transport = make_transport(
        args.transport, world, core_rank=1, flat=cell.flat_params if cell else None
    )
    if comms.cell_id is None:
        coord = Coordinator(comms, cell_ranks=list(range(1, k + 1)), objective=objective)
        reports = []
        for spec in batches:
            steps, info = batch_data(spec)
            claims = 2 * len(steps)
            joins = {int(c): int(f * (claims - 1)) for c, f in spec["joins"].items()}

            def progress(co: Coordinator, handed: int, joins=joins) -> None:
                for c in sorted(joins):
                    if handed >= joins[c]:
                        co.join(c)

            rep = coord.run_batch(
                FixedStream(steps, info, chunk=spec["chunk"]),
                end_of_burst=spec["end_of_burst"], on_progress=progress,
            )  # fmt: skip
            reports.append({"participants": rep.participants, "joins": joins,
                            "prepass_by_cell": {str(c): v for c, v in rep.prepass_by_cell.items()},
                            "steps_by_cell": {str(c): v for c, v in rep.steps_by_cell.items()},
                            "num_steps": len(steps), "update": rep.update})  # fmt: skip
        coord.stop()
        (args.out / "reports.json").write_text(json.dumps(reports))
    else:
        assert cell is not None
        saved: dict[str, np.ndarray] = {}

        def on_update(version: int, grad: torch.Tensor, params: torch.Tensor) -> None:
            saved[f"grad{version}"] = grad.numpy().copy()
            saved[f"params{version}"] = params.numpy().copy()

        opt = CoreOptimizer(cell, OptimConfig(lr=1e-3)) if comms.cell_id == 0 else None
        worker = CellWorker(comms, cell, transport, coordinator_rank=0, optimizer=opt,
                            on_update=on_update)  # fmt: skip
        worker.serve()
        saved["final"] = cell.flat_params.numpy().copy()
        saved["pulls"] = np.asarray(worker.pull_seconds)
        name = "core" if comms.cell_id == 0 else f"cell{comms.cell_id}"
        np.savez(args.out / f"{name}.npz", **saved)
    world.Barrier()
    transport.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # abort the world: a rank dying alone would leave the others waiting
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
