"""Pipeline bubble benchmark: how much of a window a Megatron cell's stage idles, measured.

    python tools/bench_pipeline.py [--stages 2 4] [--windows 1 4 8] [--repeats 3] [--json]

For each pipeline size P it starts P gloo processes on this machine (TP 1, CPU), each one
stage of `tiny:256x16` (16 layers, so the last stage's output layer over the vocabulary is
a small part of its work) in a `MegatronCell`, and runs phase-B windows of m equal
micro-steps (2 rows x 128 tokens each) through `MegatronCell.accumulate_window`, the
runtime's own 1F1B pass. A stage's idle share of a window is 1 - its busy seconds (the
cell's `WindowTiming`: the passes it ran, without the time it sat in a receive or waited
for its sends) / the window's wall seconds (barrier to barrier, so the fill and the drain
count on every stage). Printed per (P, m): the mean idle share over the stages and the
repeats, its spread (min-max over repeats of the stage mean), the busiest stage's idle
share, the stages' imbalance (the busiest stage's busy seconds over the least busy one's:
the closed form assumes equal stages, and a faster stage also waits on a slower one), and
the closed form (P - 1) / (m + P - 1) the cost model charges for equal micro-steps
(`gyre.schedule.pipeline`). One warm-up window per m is not counted.

With more stages than cores the stages share cores: a waiting stage blocks in its receive,
but a busy one competes with the others' compute, so measured busy time grows with P.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny:256x16"
ROWS, WIDTH = 2, 128


def _steps(count: int) -> list:
    """`count` equal micro-steps of random ids, the second half of each row targets."""
    import numpy as np

    from gyre.train.synthetic import random_step

    gen = np.random.default_rng(0)
    return [random_step(gen, (WIDTH,) * ROWS, vocab=256, index=i) for i in range(count)]


def stage(rank: int, stages: int, port: int, windows: list[int], repeats: int, out: str) -> None:
    """One stage's process: every window size, a warm-up then `repeats` timed windows."""
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages)  # fmt: skip
    from gyre.models import load_model
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore
    from gyre.train.objective import ObjectiveConfig
    from gyre.train.scalars import ExecutionScalar

    hf, _ = load_model(MODEL)
    hfc = hf.config.to_dict()
    shard = stage_to_mcore(dict(hf.state_dict()), WeightLayout.from_hf_config(hfc), tp_rank=0,
                           tp_size=1, stage=rank, stages=stages)  # fmt: skip
    model = build_rank_model(hfc, shard, MegatronConfig(tensor_parallel=1,
                             pipeline_parallel=stages), device="cpu")  # fmt: skip
    cell = MegatronCell(model, objective=ObjectiveConfig())
    rows = []
    for m in windows:
        steps = _steps(m)
        scalars = {r.execution_id: ExecutionScalar(advantage=1.0, num_targets=WIDTH // 2,
                                                   log_ratio=0.0, gate=1.0)
                   for s in steps for r in s.rows}  # fmt: skip
        for repeat in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            cell.accumulate_window(steps, scalars)
            dist.barrier()
            wall = time.perf_counter() - t0
            assert cell.timing is not None
            if repeat:
                rows.append({"stages": stages, "m": m, "stage": rank, "repeat": repeat,
                             "wall_s": wall, "busy_s": cell.timing.busy_s})  # fmt: skip
            cell.zero_grad()
    Path(out, f"stage{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(stages: int, windows: list[int], repeats: int) -> list[dict]:
    """Every stage's timed windows of a P-stage world."""
    with tempfile.TemporaryDirectory() as out:
        port = _port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, __file__, "--stage", str(r), str(stages),
                                   str(port), out, str(repeats), *map(str, windows)], env=env)
                 for r in range(stages)]  # fmt: skip
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"a stage of the {stages}-stage world failed")
        return [row for r in range(stages)
                for row in json.loads(Path(out, f"stage{r}.json").read_text())]  # fmt: skip


def table(rows: list[dict]) -> list[dict]:
    """Per (P, m): the measured idle share (mean, min-max over repeats) and the closed form."""
    from gyre.schedule.pipeline import bubble_share

    out = []
    for stages, m in sorted({(r["stages"], r["m"]) for r in rows}):
        mine = [r for r in rows if (r["stages"], r["m"]) == (stages, m)]
        per_repeat = [statistics.mean(1 - r["busy_s"] / r["wall_s"] for r in mine
                                      if r["repeat"] == k)
                      for k in sorted({r["repeat"] for r in mine})]  # fmt: skip
        busy = [statistics.mean(r["busy_s"] for r in mine if r["stage"] == s)
                for s in range(stages)]  # fmt: skip
        busiest = max(range(stages), key=busy.__getitem__)
        out.append({"stages": stages, "m": m, "idle": statistics.mean(per_repeat),
                    "low": min(per_repeat), "high": max(per_repeat),
                    "busiest_idle": statistics.mean(1 - r["busy_s"] / r["wall_s"] for r in mine
                                                    if r["stage"] == busiest),
                    "imbalance": max(busy) / min(busy),
                    "formula": bubble_share(stages, m),
                    "window_s": statistics.mean(r["wall_s"] for r in mine)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [row for p in args.stages for row in run(p, args.windows, args.repeats)]
    result = table(rows)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        "| P | m | idle share, stage mean (min-max) | busiest stage | (P-1)/(m+P-1) "
        "| imbalance | window s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in result:
        print(f"| {r['stages']} | {r['m']} | {r['idle']:.2f} ({r['low']:.2f}-{r['high']:.2f}) "
              f"| {r['busiest_idle']:.2f} | {r['formula']:.2f} | {r['imbalance']:.2f} "
              f"| {r['window_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stage"]:
        a = sys.argv[2:]
        stage(int(a[0]), int(a[1]), int(a[2]), [int(x) for x in a[5:]], int(a[4]), a[3])
    else:
        main()
