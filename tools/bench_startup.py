"""How long a job takes to start: `gyre run` to its first step, per phase and rank.

    python tools/bench_startup.py [--runs 3] [--configs default megatron] [--set K=V ...] [--json]

Runs `gyre run --steps 1 --profile-startup --quiet` `--runs` times for each config — the
default (`templates/local.yaml`: coordinator, proxy node, three single-rank cells) and the
2-rank Megatron one (the same with `topology.ranks_per_cell=2 train.backend=megatron`) — and
prints each config's phase x rank table of the summaries' `startup` (docs/runtime.md
"Start-up"): every cell min/median/max seconds over the runs, the first step's too. Also
the whole command's wall time and the CPU seconds of all its processes (ranks, engines,
harnesses): on a machine with few cores, start-up is CPU-bound and that is the number to cut.
`--set` adds overrides to every config (`--set engine.zygote=false`: engines started as new
interpreters, the way to measure what the engine zygote saves; `--set topology.zygote=false`:
ranks started as new interpreters, not forked from `gyre run`'s rank zygote).
Numbers, not a test; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.runtime.shared.startup import table

CONFIGS = {
    "default": [],
    "megatron": ["topology.ranks_per_cell=2", "train.backend=megatron"],
}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class RunFailed(Exception):
    """A run that did not finish (its command, exit status and stderr tail)."""


def run_again(overrides: list[str], run_dir: Path, tries: int = 3) -> dict:
    """`one_run`, tried again after a failure (on a shared machine a run is sometimes
    killed from outside: signal 9, no error of its own); each failure is printed."""
    for attempt in range(1, tries + 1):
        try:
            return one_run(overrides, run_dir.with_name(f"{run_dir.name}-try{attempt}"))
        except RunFailed as e:
            print(f"bench_startup: run failed (try {attempt} of {tries}): {e}", file=sys.stderr)
    raise SystemExit(f"bench_startup: {tries} failed tries in a row")


def one_run(overrides: list[str], run_dir: Path) -> dict:
    """One `gyre run --steps 1`: its summary, wall seconds and CPU seconds (all processes)."""
    cmd = [sys.executable, "-m", "gyre", "run", *overrides, "--steps", "1", "--quiet",
           "--profile-startup", "--run-dir", str(run_dir)]  # fmt: skip
    cpu, t0 = _children_cpu(), time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu
    if out.returncode != 0:
        raise RunFailed(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return {"startup": summary["startup"], "wall_s": wall, "cpu_s": cpu}


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per config")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--set", nargs="*", default=[], metavar="K=V", help="overrides for all")
    ap.add_argument("--json", action="store_true", help="every run's numbers as JSON")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-startup-") as tmp:
        for name in args.configs:
            results[name] = [run_again([*CONFIGS[name], *args.set], Path(tmp) / f"{name}-{i}")
                             for i in range(args.runs)]  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for name, runs in results.items():
        first = [r["startup"]["first_step_s"] for r in runs]
        given = " ".join([*CONFIGS[name], *args.set]) or "templates/local.yaml"
        print(f"\n{name} ({given}), {len(runs)} "
              f"runs, seconds min/median/max")  # fmt: skip
        print(table([r["startup"] for r in runs]))
        print(f"first step {spread(first)} s; whole command {spread([r['wall_s'] for r in runs])}"
              f" s; CPU of all processes {spread([r['cpu_s'] for r in runs])} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
