"""Benchmark of `gyre trace export` and `gyre trace stats` on a synthetic 1M-token trace.

Builds a trace with the real `TraceWriter` (executions of xLong-horizon shape: hundreds of
calls each, a compaction branch every `--compact-every` calls, tool results as new input),
then times the export to Parquet (tables only, and with the per-token table), to CSV, and
the statistics, each on the same file. Prints one JSON object of seconds and sizes.

    OMP_NUM_THREADS=1 python tools/bench_export.py [--tokens 1000000] [--executions 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from gyre.trajectory.export import export_trace
from gyre.trajectory.stats import run_stats
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import Provenance, TrajectoryTree


def build_tree(eid: str, calls: int, tokens_per_call: int, compact_every: int,
               rng: np.random.Generator) -> TrajectoryTree:  # fmt: skip
    """One execution: a main chain of calls with a compaction branch now and then."""
    tree = TrajectoryTree(eid)
    parent, t = 0, 1.8e9
    n_out = max(1, tokens_per_call // 8)
    for k in range(1, calls + 1):
        n_in = tokens_per_call - n_out
        prov = np.full(n_in, Provenance.TOOL, np.uint8)
        prov[:4] = Provenance.TEMPLATE
        compaction = k % compact_every == 0
        node = tree.add_node(
            parent_id=0 if compaction else parent,
            input_ids=rng.integers(0, 150_000, n_in, dtype=np.int32),
            input_provenance=prov,
            output_ids=rng.integers(0, 150_000, n_out, dtype=np.int32),
            output_logprobs=-rng.random(n_out, dtype=np.float32),
            role="compaction" if compaction else "main",
            policy_version=k // 50,
            engine_id=f"e{k % 3}",
            t_start=t,
            t_end=t + 2.0,
            finish_reason="tool_calls",
            input_key=b"",
            output_key=b"",
            attempts=1 + (k % 97 == 0),
        )
        parent, t = node.node_id, t + 2.5
    return tree


def build_trace(path: Path, tokens: int, executions: int, calls: int, compact_every: int) -> int:
    rng = np.random.default_rng(0)
    per_call = max(16, tokens // (executions * calls))
    with TraceWriter(path, run_meta={"bench": "export"}) as w:
        for x in range(executions):
            eid = f"g{x // 2}-e{x % 2}"
            w.open_execution(eid, {"group": f"g{x // 2}", "task": "bench"})
            tree = build_tree(eid, calls, per_call, compact_every, rng)
            w.close_execution(eid, tree, status="completed", meta={"reward": 0.5})
            w.append("rewards", [{"execution_id": eid, "group_id": f"g{x // 2}",
                                  "reward": 0.5, "valid": True, "t": 0.0}])  # fmt: skip
        rows = [{"step": s, "t": float(s), "name": n, "value": 0.1} for s in range(10)
                for n in ("loss", "reward_mean")]  # fmt: skip
        w.append("steps", rows)
    return per_call * calls * executions


def timed(fn: object, *args: object, **kwargs: object) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)  # type: ignore[operator]
    return round(time.perf_counter() - t0, 3)


def size_mb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.iterdir()) / 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="stored tokens in all")
    parser.add_argument("--executions", type=int, default=4)
    parser.add_argument("--calls", type=int, default=250, help="model calls per execution")
    parser.add_argument("--compact-every", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trace = root / "trace.h5"
        stored = build_trace(trace, args.tokens, args.executions, args.calls, args.compact_every)
        out = {"stored_tokens": stored, "calls": args.calls * args.executions,
               "trace_mb": round(trace.stat().st_size / 1e6, 2)}  # fmt: skip
        for name, fmt, tokens in (("parquet", "parquet", False), ("parquet_tokens", "parquet", True),
                                  ("csv_tokens", "csv", True)):  # fmt: skip
            folder = root / name
            out[f"export_{name}_s"] = timed(export_trace, trace, folder, fmt=fmt, tokens=tokens)
            out[f"export_{name}_mb"] = size_mb(folder)
        out["stats_s"] = timed(run_stats, trace)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
