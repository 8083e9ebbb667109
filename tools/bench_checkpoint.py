"""What a checkpoint costs: seconds and bytes per checkpoint, for the default and a larger model.

    python tools/bench_checkpoint.py [--models tiny tiny:256x4] [--repeats 5] [--json]

For each model: the core's replica and AdamW (the training backend's own `build`), one update
so the optimizer holds both moments, then `repeats` checkpoints exactly as a run takes them
— `checkpoint.begin`, the core's `save_core` (weights + optimizer), `commit` (driver state,
rename, prune) — timed whole. Also the time to load one back (`load_core`), which is what a
resumed run pays per rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(model: str, repeats: int) -> dict[str, float]:
    import torch

    from gyre.runtime.shared import checkpoint
    from gyre.runtime.shared.config import load_run_config

    torch.set_num_threads(1)
    cfg = load_run_config(ROOT / "templates" / "local.yaml", [f"model={model}"])
    replica = cfg.train_backend.build(cfg.model, cfg.train, cfg.dims, core=True,
                                      device=cfg.train.device)  # fmt: skip
    assert replica.optimizer is not None
    replica.optimizer.step(torch.randn_like(replica.cell.flat_params))  # moments exist now
    named = replica.main_named()  # the weights a checkpoint keeps (float32 main weights)
    assert named is not None
    seconds, size = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        for v in range(1, repeats + 1):
            t0 = time.perf_counter()
            folder = checkpoint.begin(run_dir, v)
            size = checkpoint.save_core(folder, named, replica.optimizer_state(), v)
            state = checkpoint.CheckpointState(version=v, updates=v, trained=(), next_group=0,
                                               t=time.time())  # fmt: skip
            checkpoint.commit(run_dir, folder, state, keep=2)
            seconds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checkpoint.load_core(run_dir)
        load_s = time.perf_counter() - t0
    params = replica.cell.flat_params.numel()
    return {"parameters": params, "bytes": size, "seconds_median": statistics.median(seconds),
            "seconds_max": max(seconds), "load_seconds": load_s}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "tiny:256x4"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {m: bench(m, args.repeats) for m in args.models}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for m, r in out.items():
        print(f"{m}: {r['parameters']:,} parameters, {r['bytes'] / 1e6:.1f} MB per checkpoint, "
              f"{r['seconds_median'] * 1000:.0f} ms median ({r['seconds_max'] * 1000:.0f} ms max), "
              f"load {r['load_seconds'] * 1000:.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
