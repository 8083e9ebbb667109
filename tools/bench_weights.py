"""Benchmark weight movements to an embedded engine: bytes on the wire and seconds, by path.

    python tools/bench_weights.py [--models tiny,qwen2-0.5b] [--repeats 3] [--json FILE]
    python tools/bench_weights.py --cell 2x2 [--models tiny,qwen2-0.5b] [--repeats 3]

What: for each model an embedded engine is launched the way a cell launches it
(`EngineHost`), and the weights as a bf16 replica holds them (`train.params_dtype`
bfloat16; `named_parameters()`, tied weights once) are moved to it `--repeats` times by each
path, with the cell's own calls (`publication.publish` for a publication, `EngineHost.
load_weights` for a reload — the core back to rollout, a respawn, a resume):

* before — `engine.publication: http` with one bucket as large as the model: the weights by
  value, base64 in the JSON body, as every movement was sent before buckets (the commit
  before them also sent float32: twice these bytes for a bf16 replica);
* handle — auto, the engine on this node: buckets of `engine.bucket_mb` by handle (CPU
  shared memory through torch's reductions; CUDA IPC on GPU), publication and reload;
* group — auto, the engine reached at another address (127.0.0.2, so "another node"): one
  update group per publication, one gloo broadcast per bucket (publication only: a reload
  is always on the cell's own node).

Reported per model and path: JSON body bytes sent to the engine (counted where the client
hands them to the transport), update-group bytes (the broadcast buffers), bytes copied into
shared memory (handle: the buckets), wall seconds per movement (median, min, max). After each
path the engine must serve the last version moved, or the benchmark fails.

`--cell TPxPP` publishes from a Megatron core cell instead (`MEGATRON.build` in an
`mpiexec` world of TP x PP ranks, bf16, the same engine), by two paths, each through update
groups (the ranks at 127.0.0.2) and by handle:

* before — what a Megatron cell did before publishing from the ranks that hold the weights:
  every shard of every stage gathered to the leader (`MegatronReplica._gather`, the gather
  that once refreshed the leader's whole-model mirror after every update), then the leader alone sends
  the whole model (`publish`);
* stages — `Replica.part` (each stage's TP ranks gather to the stage's sender, which
  converts its stage: `stage_to_hf`) and `publish_parts`: each sender sends its own stage.

Reported besides the wire bytes (summed over the ranks): the HF-layout bytes the leader
holds for the movement (the whole model before, stage 0's after) and the most any rank
holds; seconds include the gather.

``qwen2-0.5b`` is Qwen2.5-0.5B's shape with random weights (494 M parameters, 0.99 GB in
bf16), written as in tools/bench_shard_load.py. Prints one JSON object; the load average is
included, since a busy machine inflates every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shard_load import write_model

from gyre.models import load_model
from gyre.rollout import transport
from gyre.rollout.client import blocking
from gyre.runtime.cell import publication
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.cell.publication import publish, publish_parts
from gyre.runtime.shared.config import EngineConfig

WIRE = {"json": 0, "group": 0}


def _counting() -> None:
    """Count JSON body bytes and broadcast bytes at the points where they leave."""
    send, broadcast = transport.HttpTransport.request, publication.broadcast_tensors

    async def request(self: Any, method: str, route: str, payload: Any, timeout: Any) -> Any:
        WIRE["json"] += len(payload or b"")
        return await send(self, method, route, payload, timeout)

    def counted(pg: Any, tensors: Any) -> None:
        WIRE["group"] += sum(t.numel() * t.element_size() for t in tensors)
        broadcast(pg, tensors)

    transport.HttpTransport.request = request  # type: ignore[method-assign]
    publication.broadcast_tensors = counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,qwen2-0.5b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--cell", default="", help="TPxPP: publish from a Megatron core cell")
    p.add_argument(
        "--cell-rank", nargs=2, metavar=("MODEL", "ENGINE_URL"), help=argparse.SUPPRESS
    )  # one rank of --cell's world
    args = p.parse_args()
    _counting()
    if args.cell_rank:
        cell_rank(*args.cell_rank, args.cell, args.repeats, args.json)
        return
    report: dict[str, Any] = {"repeats": args.repeats, "cell": args.cell, "models": {}}
    for spec in args.models.split(","):
        bench = bench_cell if args.cell else bench_model
        report["models"][spec] = bench(spec, args.repeats, args.cell)
        print(f"[bench_weights] {spec}: {json.dumps(report['models'][spec])}", flush=True)
    report["load_average"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def _model_path(spec: str, tmp: str) -> str:
    if spec == "tiny":
        return spec
    path = Path(tmp) / "model"
    path.mkdir()
    write_model(path, spec, "bfloat16")
    return str(path)


def bench_model(spec: str, repeats: int, _cell: str = "") -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-weights-") as tmp:
        path = _model_path(spec, tmp)
        model, _ = load_model(path)
        named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
        del model
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        out: dict[str, Any] = {"tensors": len(named), "bf16_bytes": nbytes}
        paths = {"before": EngineConfig(publication="http", bucket_mb=(nbytes >> 20) + 1),
                 "handle": EngineConfig(), "group": EngineConfig(distributed_above_mb=0)}  # fmt: skip
        host = EngineHost(path, EngineConfig(), Path(tmp) / "engine.log", version=0)
        host.start()
        try:
            version = 0
            for name, config in paths.items():
                at = "127.0.0.2" if name == "group" else "127.0.0.1"
                movements: dict[str, Callable[[int], None]] = {
                    "publication": lambda v, c=config, a=at: _publish(host.url, named, v, c, a)
                }
                if name != "group":
                    movements["reload"] = lambda v, c=config: _reload(host, named, v, c)
                out[name] = {}
                for movement, move in movements.items():
                    runs = []
                    for _ in range(repeats):
                        version += 1
                        runs.append(_measure(move, version))
                    out[name][movement] = _summary(runs)
                served = blocking(host.url, lambda c: c.model_info())["weight_version"]
                if str(served) != str(version):
                    raise RuntimeError(f"{spec} {name}: serves {served!r}, moved {version}")
        finally:
            host.stop()
    return out


def bench_cell(spec: str, repeats: int, cell: str) -> dict[str, Any]:
    """Publications from a Megatron core cell of `cell` (TPxPP) ranks to an engine."""
    from gyre.runtime.cli import find_mpiexec

    tp, pp = (int(x) for x in cell.split("x"))
    with tempfile.TemporaryDirectory(prefix="gyre-bench-weights-") as tmp:
        path = _model_path(spec, tmp)
        host = EngineHost(path, EngineConfig(), Path(tmp) / "engine.log", version=0)
        host.start()
        try:
            out = Path(tmp) / "cell.json"
            proc = subprocess.run([find_mpiexec(), "-n", str(tp * pp), sys.executable, __file__,
                                   "--cell", cell, "--repeats", str(repeats), "--json", str(out),
                                   "--cell-rank", path, host.url],
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode:
                raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
            return dict(json.loads(out.read_text()))
        finally:
            host.stop()


def cell_rank(model: str, url: str, cell: str, repeats: int, out: str) -> None:
    """One rank of `bench_cell`'s world: build the core cell's shard, publish `repeats`
    times by each path and route, and (rank 0) write the report to `out`."""
    from mpi4py import MPI

    from gyre.train.backends.megatron import MEGATRON
    from gyre.train.comm import arrive, build_communicators
    from gyre.train.config import ParallelDims, TrainConfig

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comms = build_communicators(world, cell_of_rank=[0] * world.Get_size())
    tp, pp = (int(x) for x in cell.split("x"))
    replica = MEGATRON.build(model, TrainConfig(backend="megatron", dtype="bfloat16"),
                             ParallelDims(tensor=tp, pipeline=pp, data=1), core=False,
                             device="cpu", comms=comms, host="127.0.0.1")  # fmt: skip

    def before(version: int, config: EngineConfig, at: str) -> int:
        whole = replica._gather(replica._views(replica.cell.flat_params))
        if whole is not None:
            _publish(url, sorted(whole.items()), version, config, at)
        return _nbytes(whole.items()) if whole is not None else 0

    def stages(version: int, config: EngineConfig, at: str) -> int:
        part = replica.part(comms.shard)
        missed = publish_parts(comms.cell, part, [(0, url)], version, config, at)
        if missed:
            raise RuntimeError(f"publication {version} missed")
        return _nbytes(part) if part is not None else 0

    routes = {"group": (EngineConfig(publication="distributed"), "127.0.0.2"),
              "handle": (EngineConfig(), "127.0.0.1")}  # fmt: skip
    report: dict[str, Any] = {"ranks": tp * pp, "tensor": tp, "pipeline": pp}
    version = 0
    for name, move in (("before", before), ("stages", stages)):
        for route_name, (config, at) in routes.items():
            runs = []
            for _ in range(repeats):
                version += 1
                arrive(world, 0.005)
                WIRE.update(json=0, group=0)
                t0 = time.perf_counter()
                held = move(version, config, at)
                arrive(world, 0.005)
                secs = time.perf_counter() - t0
                runs.append({"s": secs, "json_bytes": world.allreduce(WIRE["json"]),
                             "group_bytes": world.allreduce(WIRE["group"]),
                             "leader_holds": world.bcast(held), "most_held": world.allreduce(held, op=MPI.MAX)})  # fmt: skip
            report[f"{name}/{route_name}"] = {**_summary(runs), "leader_holds": runs[-1]["leader_holds"],
                                              "most_held": runs[-1]["most_held"]}  # fmt: skip
    if world.Get_rank() == 0:
        served = blocking(url, lambda c: c.model_info())["weight_version"]
        if str(served) != str(version):
            raise RuntimeError(f"serves {served!r}, moved {version}")
        Path(out).write_text(json.dumps(report))


def _nbytes(named: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _publish(url: str, named: Any, version: int, config: EngineConfig, at: str) -> None:
    if publish([(0, url)], named, version, config, host=at):
        raise RuntimeError(f"publication {version} missed")


def _reload(host: EngineHost, named: Any, version: int, config: EngineConfig) -> None:
    host.engine_config = config
    host.load_weights(named, version)


def _measure(move: Callable[[int], None], version: int) -> dict[str, float]:
    WIRE.update(json=0, group=0)
    t0 = time.perf_counter()
    move(version)
    return {"s": time.perf_counter() - t0, "json_bytes": WIRE["json"], "group_bytes": WIRE["group"]}


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    secs = [r["s"] for r in runs]
    return {"s_median": statistics.median(secs), "s_min": min(secs), "s_max": max(secs),
            "json_bytes": runs[-1]["json_bytes"], "group_bytes": runs[-1]["group_bytes"]}  # fmt: skip


if __name__ == "__main__":
    main()
