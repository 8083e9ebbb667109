"""Benchmark reroute latency with and without KV-cache migration (paper §4.3).

    python tools/bench_reroute.py [--sizes 4096,16384,65536] [--transports http,mooncake]
                                  [--repeats 1] [--threads 1] [--json FILE]

A source and a destination embedded engine (one torch thread each, as in `gyre run`) serve
the tiny model. For each context size N one execution has a call of N input tokens decoding
on the source when the cell switches to TRAIN, and the switch runs as the cell and the proxy
run it:

* **recompute** (no migration): the cell aborts the source's calls (`/abort_request`
  abort_all); the aborted call comes back and the proxy retries it, with the same input, at
  the destination, which prefills all N tokens;
* **migrate** (per transport): the cell first runs `gyre.rollout.kvmigrate.migrate_kv`
  (pin at the source, Mooncake or HTTP read + acknowledgement at the destination, release),
  then aborts; the retried call finds N - 1 tokens in the destination's prefix cache.

Reported per case: the reroute latency from the abort until the destination produced the
first token of the retried call (`abort_to_first_token_s`; the retry asks for one token),
the migration's own time before the abort (`migration_s`), their sum (`switch_to_first_
token_s`: what a rerouted harness call waits from the start of the switch), `cached_tokens`
of the retried call and the bytes moved. The destination's prefix cache is flushed before
every case, and the source serves the running call from its own prefix cache, so only the
reroute is timed.

The `tiny` model has 32768 positions, so a 64k-token context does not fit it: the benchmark
saves the same model (same seed, same weights) with `max_position_embeddings` 131072 into a
temporary directory and serves that directory (the engine takes any local Hugging Face
model directory). Token ids are random (seed 0): timing does not depend on the text. Prints
one JSON object (and writes it to --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gyre.rollout.client import EngineClient
from gyre.rollout.kvmigrate import execution_prefix, migrate_kv
from gyre.rollout.protocol import SamplingParams
from gyre.rollout.testing import running_engine

FIRST_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
DECODING = SamplingParams(max_new_tokens=50_000, temperature=0.0, ignore_eos=True)
POSITIONS = 131072


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-tiny-128k-") as folder:
        model = save_long_tiny(Path(folder))
        engine = {"threads": args.threads, "startup_timeout": 300.0,
                  "prefix_cache_mb": 2048}  # fmt: skip
        with running_engine(model, **engine) as source, running_engine(model, **engine) as dest:
            report = asyncio.run(bench(source, dest, args))
    report["load_average"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4096,16384,65536", help="context sizes (tokens)")
    p.add_argument("--transports", default="http,mooncake", help="migration transports")
    p.add_argument("--repeats", type=int, default=1, help="runs per case (the median is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--json", default="", help="also write the report to this file")
    return p.parse_args()


def save_long_tiny(folder: Path) -> str:
    """The tiny model and tokenizer with 131072 positions, as a model directory."""
    from gyre.models import load_model

    model, tok = load_model("tiny")
    model.config.max_position_embeddings = POSITIONS
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


async def bench(source: str, dest: str, args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    transports = [t for t in args.transports.split(",") if t]
    rng = np.random.default_rng(0)
    cases: list[dict[str, Any]] = []
    for n in sizes:
        ids = rng.integers(5, 4000, n).tolist()
        await EngineClient(source).generate(ids, FIRST_TOKEN, f"warm{n}-0-00-1")  # source cache
        for mode in ["recompute", *transports]:
            runs = [
                await reroute(source, dest, ids, mode, f"b{n}{mode}{r}")
                for r in range(args.repeats)
            ]
            cases.append(summary(n, mode, runs))
            print(json.dumps(cases[-1]), flush=True)
    return {"model": "tiny (64x2) with 131072 positions", "cases": cases}


async def reroute(source: str, dest: str, ids: list[int], mode: str, eid: str) -> dict[str, Any]:
    """One switch: [migrate,] abort all at the source, retry at the destination."""
    src, dst = EngineClient(source), EngineClient(dest)
    await dst.flush_cache()
    call = asyncio.ensure_future(src.generate(ids, DECODING, f"{eid}-2-ab-1"))
    while (await src.stats())["running"] == 0:
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    moved = None
    if mode != "recompute":
        routes = {execution_prefix(eid): dest}
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(None, lambda: migrate_kv(source, routes, transport=mode))
        moved = done[execution_prefix(eid)]
    t_abort = time.perf_counter()
    await src.abort_all()
    aborted = await call
    retried = await dst.generate(ids, FIRST_TOKEN, f"{eid}-2-ab-2")
    t1 = time.perf_counter()
    assert aborted.finish_type == "abort" and retried.completion_tokens == 1
    if moved is not None and moved.outcome != "migrated":
        raise SystemExit(f"migration over {mode} failed: {moved.error}")
    return {
        "abort_to_first_token_s": t1 - t_abort,
        "migration_s": t_abort - t0,
        "switch_to_first_token_s": t1 - t0,
        "cached_tokens": retried.cached_tokens,
        "bytes_moved": moved.nbytes if moved else 0,
    }


def summary(n: int, mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("abort_to_first_token_s", "migration_s", "switch_to_first_token_s")
    out: dict[str, Any] = {"tokens": n, "mode": mode}
    out.update({k: round(statistics.median(r[k] for r in runs), 4) for k in keys})
    out["cached_tokens"] = runs[-1]["cached_tokens"]
    out["bytes_moved"] = runs[-1]["bytes_moved"]
    return out


if __name__ == "__main__":
    main()
