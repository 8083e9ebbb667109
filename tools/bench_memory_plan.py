"""The memory plan against real training on CPU: predicted vs measured peak per rank.

    python tools/bench_memory_plan.py [--json] [--cases NAME,...]

What: for three model shapes, each case runs the runtime's own training code on CPU in a
fresh `mpiexec` world of the cell's ranks — the backend's `build` (torch: the whole model
per rank; Megatron: TP 1 and TP 2, gloo), then twice: a phase-B micro-step
(`TorchCell.accumulate`), the core's update (`reduce_to_core`, `batch_gradient`,
`CoreOptimizer.step`, as the cell's trainer calls them), `zero_grad` — and reads
every rank's peak resident memory above its resident memory before the build (imports
done). The prediction is `gyre.train.memory`'s, for the same shape and layout
(`MemoryPlan.device_bytes`: the rank's peak). A miss beyond 15 % is reported, not hidden.

Why: `gyre plan --memory` and the preflight refuse layouts by these predictions; the table
in docs/gpu.md is this bench's output.

How: peak RSS from `peak_rss` (tools/, the benches' one measurement: VmHWM after a
`clear_refs` reset). Shapes are the tiny family (`tiny:HIDDENxLAYERS`: 4 heads, 2 KV heads,
MLP twice the width, vocabulary 4096, float32 on CPU), so the micro-step's activations and
logits, not the weights, decide most peaks; one case runs Megatron's `local` attention to
exercise the quadratic term. Single-threaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # this checkout's gyre, the benches' tools
from peak_rss import mpiexec, peak_bytes, reset_peak, rss_bytes  # noqa: E402

# name -> (model spec, backend, TP, attention, row tokens, token budget)
CASES: dict[str, tuple[str, str, int, str, int, int]] = {
    "256x4/torch": ("tiny:256x4", "torch", 1, "sdpa", 2048, 4096),
    "256x4/megatron-tp1": ("tiny:256x4", "megatron", 1, "sdpa", 2048, 4096),
    "256x4/megatron-tp2": ("tiny:256x4", "megatron", 2, "sdpa", 2048, 4096),
    "512x8/torch": ("tiny:512x8", "torch", 1, "sdpa", 4096, 4096),
    "512x8/megatron-tp1": ("tiny:512x8", "megatron", 1, "sdpa", 4096, 4096),
    "512x8/megatron-tp2": ("tiny:512x8", "megatron", 2, "sdpa", 4096, 4096),
    "128x2/torch": ("tiny:128x2", "torch", 1, "sdpa", 8192, 8192),
    "128x2/megatron-tp1": ("tiny:128x2", "megatron", 1, "sdpa", 8192, 8192),
    "128x2/megatron-tp2": ("tiny:128x2", "megatron", 2, "sdpa", 8192, 8192),
    "128x2/megatron-tp1-local": ("tiny:128x2", "megatron", 1, "local", 4096, 4096),
}
"""Three shapes, each on the torch backend and Megatron at TP 1 and 2 (one local case)."""


def _step(tokens: int, row: int, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """A phase-B micro-step of `tokens // row` rows of `row` tokens, every position a target."""
    import numpy as np

    from gyre.train.objective import ExecutionScalar
    from gyre.train.packing import MicroStep, TokenRow

    rng = np.random.default_rng(seed)
    rows, scalars = [], {}
    for i in range(max(1, tokens // row)):
        targets = np.arange(row) >= 1
        rows.append(TokenRow(execution_id=f"e{i}", group_id="g", policy_version=0,
                             ids=rng.integers(0, 4096, row).astype(np.int64), targets=targets,
                             behaviour_logprobs=np.where(targets, -8.0, 0.0), advantage=1.0,
                             execution_targets=int(targets.sum()),
                             weights=targets / targets.sum()))  # fmt: skip
        scalars[f"e{i}"] = ExecutionScalar(advantage=1.0, num_targets=int(targets.sum()),
                                           log_ratio=0.0, gate=1.0)  # fmt: skip
    return MicroStep(index=0, rows=tuple(rows)), scalars


def child(case: str, out: str) -> None:
    """One rank of one case: build, then (micro-step, update) twice; rank 0 writes
    every rank's bytes above its pre-build RSS at the peak."""
    import warnings

    import torch
    from mpi4py import MPI
    from transformers import Qwen2ForCausalLM  # noqa: F401 (its ~150 MB of modules: before the baseline)

    from gyre.models import tiny_tokenizer
    from gyre.train.backends import backend
    from gyre.train.comm import build_communicators, reduce_to_core
    from gyre.train.config import ParallelConfig, TrainConfig
    from gyre.train.objective import batch_gradient

    spec, name, tp, attention, row, budget = CASES[case]
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if name == "megatron":
        import megatron.core.models.gpt.gpt_model  # noqa: F401

        from gyre.train.megatron.config import MegatronConfig

        # the backend builds with MegatronConfig's default attention (sdpa): a local case
        # changes the default for this process
        MegatronConfig.__init__.__kwdefaults__["attention"] = attention
    tiny_tokenizer()
    world = MPI.COMM_WORLD
    comms = build_communicators(world, cell_of_rank=[0] * world.Get_size())
    trainer = backend(name)
    train = TrainConfig(backend=name, token_budget=budget, parallel=ParallelConfig(tensor=tp))
    dims = trainer.dims(train.parallel, world.Get_size())
    before = rss_bytes()
    reset_peak()
    replica = trainer.build(spec, train, dims, core=True, device="cpu", comms=comms)
    built = peak_bytes() - before
    reset_peak()
    step, scalars = _step(budget, row)
    phases: dict[str, int] = {}
    peak = 0

    def phase(name: str, run: Any) -> Any:
        nonlocal peak
        start = rss_bytes() - before
        reset_peak()
        result = run()
        phases[name] = max(phases.get(name, 0), peak_bytes() - before)
        phases[f"{name} start"] = max(phases.get(f"{name} start", 0), start)
        peak = max(peak, phases[name])
        return result

    assert replica.optimizer is not None
    for _ in range(2):
        phase("micro-step", lambda: replica.cell.accumulate(step, scalars))
        phase(
            "update",
            lambda: replica.optimizer.step(
                batch_gradient(  # type: ignore[union-attr]
                    reduce_to_core(comms, replica.cell.flat_grads, participants=1), len(scalars)
                )
            ),
        )
        replica.cell.zero_grad()
    rows = world.gather({"rank": world.Get_rank(), "peak": peak, "build_peak": built,
                         "phases": phases}, root=0)  # fmt: skip
    if rows is not None:
        Path(out).write_text(json.dumps(rows))


def predict(case: str) -> list[int]:
    """`gyre.train.memory`'s bytes per rank of the case (`MemoryPlan.device_bytes` on CPU)."""
    from gyre.models import model_config
    from gyre.train.memory import MemoryPlan, ModelShape, TrainLayout

    spec, name, tp, attention, row, budget = CASES[case]
    shape = ModelShape.from_hf(model_config(spec).to_dict())
    # sequence parallel at TP > 1: the backend's default (`measure` runs it)
    layout = TrainLayout(backend=name, tensor=tp, dtype="float32", attention=attention,  # type: ignore[arg-type]
                         row_tokens=row, token_budget=budget,
                         sequence=name == "megatron" and tp > 1)  # fmt: skip
    plan = MemoryPlan(shape=shape, layout=layout, gpu=False, limit=None)
    return [plan.device_bytes(r) for r in plan.ranks]


MMAP_THRESHOLD = 1 << 17
"""glibc's mmap threshold in the measured runs: blocks of 128 KiB and more are mapped and
unmapped, so a freed tensor leaves the RSS (glibc's default threshold grows to the largest
block freed, which then stays in the heap: the RSS never falls after a pass, and the next
pass's tensors land beside the kept ones). `--default-malloc` measures that too."""


def measure(case: str, default_malloc: bool = False) -> list[dict[str, Any]]:
    """Every rank's bytes of `case` (its own `mpiexec` world)."""
    tp = CASES[case][2] if CASES[case][1] == "megatron" else 1
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [mpiexec(), "-n", str(tp), sys.executable, __file__, "--child", case, str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore"}  # fmt: skip
        if not default_malloc:
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        return list(json.loads(out.read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--phases", action="store_true", help="each phase's measured peak")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from mpi4py import MPI

        try:
            child(*args.child)
        except BaseException:  # abort the whole world instead of hanging it
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        return 0
    rows = []
    print("MB = 2**20 bytes; error = (predicted - measured) / measured; glibc: the default "
          "malloc's peak", file=sys.stderr)  # fmt: skip
    print(f"{'case':<26} {'rank':>4} {'predicted':>9} {'measured':>8} {'error':>7} "
          f"{'glibc':>6} {'error':>7}", file=sys.stderr)  # fmt: skip
    for case in args.cases.split(","):
        predicted = predict(case)
        default = {r["rank"]: r["peak"] for r in measure(case, default_malloc=True)}
        for got in measure(case):
            p, m, d = predicted[got["rank"]], got["peak"], default[got["rank"]]
            err = (p - m) / m
            rows.append({"case": case, **got, "predicted": p, "error": err,
                         "default_malloc_peak": d})  # fmt: skip
            if args.phases:
                print(json.dumps(got["phases"]), file=sys.stderr)
            flag = "" if abs(err) <= 0.15 else "  MISS"
            print(f"{case:<26} {got['rank']:>4} {p / 2**20:>9.0f} {m / 2**20:>8.0f} "
                  f"{100 * err:>6.1f}% {d / 2**20:>6.0f} {100 * (p - d) / d:>6.1f}%{flag}",
                  file=sys.stderr, flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
