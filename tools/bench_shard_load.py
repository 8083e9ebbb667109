"""Peak resident memory per rank of building a Megatron cell: one shard per rank.

    python tools/bench_shard_load.py [--shape qwen2-0.5b|quarter] [--dtype float32|bfloat16]
                                     [--runs 3] [--build-only] [--resume] [--json] [--code DIR]

Writes a random Qwen2 model of the chosen shape as safetensors (shards of ≤ 512 MB and
their ``model.safetensors.index.json``, as `save_pretrained` lays out a checkpoint) with
the tiny tokenizer into a temporary directory, then builds a Megatron core cell of it
(`MEGATRON.build`: the runtime's own code, optimizer included) in an `mpiexec` world of
TP = 1 and TP = 2 ranks, `--runs` times each, and reports every rank's peak RSS (the
kernel's high-water mark, VmHWM) after the build and after the first publication's part
(`Replica.part`: each stage's shards gathered to its sender), and build seconds: min /
median / max over the runs. No rank holds the whole model (docs/gpu.md); every rank reads
only its slices of the files. Gyre trains in float32 today; `--dtype bfloat16` writes the
files as released checkpoints are (the ranks read half the bytes and cast).

Shapes: ``qwen2-0.5b`` is Qwen2.5-0.5B's (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151936, tied: 494 M parameters, 2.0 GB in float32);
``quarter`` halves hidden, intermediate and vocabulary (124 M parameters: every tensor a
quarter, the embedding's share of the model kept) for a machine where a whole-model
float32 rank of the larger one would not fit beside other work.

`--code DIR` runs the ranks with another checkout's `gyre` (e.g. `git archive` of an older
commit), for before/after numbers on the same model files; `--build-only` skips the part.
`--resume` measures instead what a rank adds to its peak RSS while it resumes a checkpoint
taken at the other TP size (one AdamW step, so both moments are in it): TP 2's shards at
TP 1 and TP 1's at TP 2.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from peak_rss import mpiexec, peak_bytes, peak_mb, reset_peak, rss_bytes  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936},
    "quarter": {"hidden_size": 448, "num_hidden_layers": 24, "num_attention_heads": 14,
                "num_key_value_heads": 2, "intermediate_size": 2432, "vocab_size": 75968},
}  # fmt: skip
SHARD_BYTES = 512 * 2**20


def write_model(folder: Path, shape: str, dtype: str = "float32") -> int:
    """A random Qwen2 of `shape` in `dtype` as sharded safetensors + index, config and the tiny
    tokenizer in `folder`; its parameter count. Tensors are made one at a time (names and
    shapes from a meta-device model), so this process holds one shard file's worth."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gyre.models import tiny_tokenizer

    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, dtype=dtype)
    with torch.device("meta"):
        names = [(n, p.shape) for n, p in Qwen2ForCausalLM(config).state_dict().items()
                 if n != "lm_head.weight"]  # fmt: skip
    groups: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, shp in names:  # files of at most SHARD_BYTES, in order
        nbytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size() * shp.numel()
        if size and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shp))
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: (torch.randn(shp, generator=gen) * 0.02).to(getattr(torch, dtype))
                   for name, shp in group}  # fmt: skip
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return total


def child(model: str, tp: int, out: str, then: str) -> None:
    """One rank: build the core cell's shard of `model` at TP `tp`, then `then`: "refresh"
    (a publication's part), "save=DIR" (one AdamW step, then a checkpoint's shards in DIR,
    as `checkpoint.save_core` has each core rank write its own) or "restore=DIR" (the
    resume of DIR's checkpoint: its extra peak RSS over what the rank held before), else
    nothing; rank 0 writes every rank's peak RSS and build seconds to `out`."""
    from mpi4py import MPI

    from gyre.train.backends.megatron import MEGATRON
    from gyre.train.comm import build_communicators
    from gyre.train.config import ParallelDims, TrainConfig

    world = MPI.COMM_WORLD
    comms = build_communicators(world, cell_of_rank=[0] * world.Get_size())
    dims = ParallelDims(tensor=tp, pipeline=1, data=1)
    t0 = time.perf_counter()
    replica = MEGATRON.build(model, TrainConfig(backend="megatron"), dims, core=True,
                             device="cpu", comms=comms, host="127.0.0.1")  # fmt: skip
    row = {"rank": world.Get_rank(), "build_s": time.perf_counter() - t0,
           "peak_rss_mb": peak_mb()}  # fmt: skip
    if then == "refresh":  # what every publication does: a stage's shards gathered to its sender
        replica.part(comms.shard)
        row["peak_after_refresh_mb"] = peak_mb()
    elif then.startswith("save="):
        import torch

        assert replica.optimizer is not None
        replica.optimizer.step(torch.randn_like(replica.cell.flat_params))  # moments exist now
        replica.save(Path(then[5:]), 1, world.Get_rank())
    elif then.startswith("restore="):
        before = rss_bytes()
        reset_peak()
        replica.restore(Path(then[8:]))
        row["restore_extra_mb"] = (peak_bytes() - before) / 2**20
    rows = world.gather(row, root=0)
    if rows is not None:
        Path(out).write_text(json.dumps(rows))


def run_world(model: Path, tp: int, code: Path, then: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [mpiexec(), "-n", str(tp), sys.executable, __file__, "--child", str(model),
               str(tp), str(out), then]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        return list(json.loads(out.read_text()))


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


PEAKS = ("peak_rss_mb", "peak_after_refresh_mb")
"""The peaks each rank reports: after building the cell, after the first refresh."""


def bench(shape: str, dtype: str, runs: int, code: Path, refresh: bool) -> dict:
    """Every rank's peak RSS (MB) and build seconds at TP 1 and 2, over `runs` worlds each
    (alternating TP 1 and TP 2, so both see the same machine load)."""
    with tempfile.TemporaryDirectory() as tmp:
        params = write_model(Path(tmp), shape, dtype)
        seen: dict[int, list[list[dict]]] = {1: [], 2: []}
        for _ in range(runs):
            for tp in (1, 2):
                seen[tp].append(run_world(Path(tmp), tp, code, "refresh" if refresh else ""))
    report: dict = {"shape": {**SHAPES[shape], "name": shape, "parameters": params},
                    "file_dtype": dtype, "runs": runs, "code": str(code),
                    "machine": f"{os.cpu_count()} CPUs, OMP_NUM_THREADS=1"}  # fmt: skip
    peaks = PEAKS if refresh else PEAKS[:1]
    for tp, worlds in seen.items():
        report[f"tp{tp}"] = {
            f"rank{r}": {key: summary([w[r][key] for w in worlds]) for key in (*peaks, "build_s")}
            for r in range(tp)
        }
    one = report["tp1"]["rank0"]
    report["tp2_over_tp1"] = {
        f"rank{r}": {key: report["tp2"][f"rank{r}"][key]["median"] / one[key]["median"]
                     for key in peaks}
        for r in range(2)
    }  # fmt: skip
    return report


def bench_resume(shape: str, runs: int, code: Path) -> dict:
    """Each rank's extra peak RSS (MB) while it resumes a checkpoint taken at the other TP
    size (TP 2's shards at TP 1, TP 1's at TP 2: each rank's shard split from the files a
    layer at a time, `core_file.source`),
    over `runs` worlds each, beside the model's float32 bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        model, saved = Path(tmp) / "model", {tp: Path(tmp) / f"saved-tp{tp}" for tp in (1, 2)}
        model.mkdir()
        params = write_model(model, shape)
        for tp, folder in saved.items():
            folder.mkdir()
            run_world(model, tp, code, f"save={folder}")
        seen: dict[int, list[list[dict]]] = {1: [], 2: []}
        for _ in range(runs):
            for tp in (1, 2):
                seen[tp].append(run_world(model, tp, code, f"restore={saved[3 - tp]}"))
    return {"shape": {**SHAPES[shape], "name": shape, "parameters": params},
            "model_float32_mb": params * 4 / 2**20, "runs": runs, "code": str(code),
            **{f"tp{tp}_from_tp{3 - tp}": {f"rank{r}": summary([w[r]["restore_extra_mb"]
                                                                for w in worlds])
                                           for r in range(tp)}
               for tp, worlds in seen.items()}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the files' dtype (the cell trains in float32)",
    )
    ap.add_argument("--runs", type=int, default=3, help="worlds per TP size (default 3)")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout the ranks import")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--build-only", action="store_true", help="no refresh after the build")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="instead: each rank's extra peak RSS resuming at the other TP size",
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from mpi4py import MPI

        try:
            child(args.child[0], int(args.child[1]), args.child[2], args.child[3])
        except BaseException:  # abort the whole world instead of hanging it
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        return 0
    if args.resume:
        found = bench_resume(args.shape, args.runs, args.code.resolve())
        if args.json:
            print(json.dumps(found, indent=2))
            return 0
        print(f"{found['shape']['name']}: {found['shape']['parameters'] / 1e6:.0f} M parameters "
              f"({found['model_float32_mb']:.0f} MB in float32); {found['runs']} runs; "
              f"code {found['code']}")  # fmt: skip
        print("extra peak RSS MB while resuming at the other TP size, min / median / max")
        for key in ("tp1_from_tp2", "tp2_from_tp1"):
            for rank, v in found[key].items():
                print(f"{key}  {rank}  {v['min']:7.0f} / {v['median']:7.0f} / {v['max']:7.0f}")
        return 0
    report = bench(args.shape, args.dtype, args.runs, args.code.resolve(), not args.build_only)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    s = report["shape"]
    print(f"{s['name']}: {s['parameters'] / 1e6:.0f} M parameters, files {report['file_dtype']}; "
          f"{report['runs']} runs per TP size; code {report['code']}")  # fmt: skip
    print("peak RSS MB, min / median / max; the ratio is the median's to TP 1's")
    peaks = [key for key in PEAKS if key in report["tp1"]["rank0"]]
    heads = {"peak_rss_mb": "building the cell", "peak_after_refresh_mb": "after the first refresh"}
    print("TP  rank  " + "".join(f"{heads[key]:<30} ratio  " for key in peaks) + "build s")
    one = report["tp1"]["rank0"]
    for tp in (1, 2):
        for r in range(tp):
            row = report[f"tp{tp}"][f"rank{r}"]
            cols = "".join(
                f"{row[k]['min']:7.0f} / {row[k]['median']:7.0f} / {row[k]['max']:7.0f}  "
                f"{row[k]['median'] / one[k]['median']:5.2f}  "
                for k in peaks
            )
            print(f"{tp:>2}  {r:>4}  {cols}{row['build_s']['median']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
