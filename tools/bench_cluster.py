"""The cluster on one machine: Elastic, Async and Colocate on the paced cluster workload, each
run checked against the simulator's replay of it.

    python tools/bench_cluster.py [--config templates/bench/cluster.yaml] [--steps 8]
                                  [--seeds 3] [--first-seed 0] [--staleness 1.5] [--quick]
                                  [--json] [--keep DIR]

For every seed and policy: the real `gyre run` (MPI world, proxy, harness processes, tool
latency, scheduler, reroutes) on the paced template (`pace:`, docs/pacing.md), at the (φ, μ)
`gyre plan` gives that policy for the same E[d] (`bench_policies.run_policy`, the policy
benchmark's own runner), then `gyre sim --replay` of the run. Per run: wall seconds, paced
hours (wall x scale), the replay's predicted hours (sim_h), how often real work overran its
modelled time, satellite joins (steps with more than one training cell) and reroutes; the
held-out reward of the policy at the middle and the end of the run (`--eval-every`), and the
paced hours to `--target`. Per policy: the median over seeds; the ratios async/elastic and
colocate/elastic in paced time (> 1: Elastic is faster); the runtime-vs-replay error.

`--quick` (one seed, 4 steps, held-out at the end only) took 12 min 45 s here (2026-12-03,
before the template's hard queries).
`--json` prints {"policies": {"elastic": {"wall_s", "paced_h", "sim_h", ...}, ...},
"ratios": ..., "runs": [...]}. Each kept run directory has its role timeline
(`gyre report RUN_DIR`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policies import POLICIES, burst_steps, held_out, run_policy, study_arguments


def replay_h(run_dir: Path, scale: float, seeds: int = 5) -> float:
    """The replay's prediction of the run, in modelled hours (`gyre sim --replay --json`)."""
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "sim", "--replay", str(run_dir), "--json",
         "--seeds", str(seeds)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    walls = json.loads(out.stdout)["replay_wall_s"]
    return statistics.fmean(walls) * scale / 3600


def one_run(base: dict[str, Any], policy: str, seed: int, args: argparse.Namespace,
            work: Path) -> dict[str, Any]:  # fmt: skip
    cfg = json.loads(json.dumps(base))
    cfg["train"]["seed"] = seed
    cfg["name"] = f"{cfg['name']}-s{seed}"
    where = work / f"seed{seed}"
    where.mkdir(parents=True, exist_ok=True)
    row = run_policy(cfg, policy, args.steps, args.staleness, where, args.min_phi)
    run_dir = Path(row["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    pace = summary["pace"]
    scale = float(pace["scale"])
    row.update(
        seed=seed,
        paced_h=pace["paced_h"],
        sim_h=replay_h(run_dir, scale),
        overruns={"calls": pace["calls"], "cell_work": pace["cell_work"]},
        joined_steps=summary.get("satellite_steps"),  # Elastic only: the others fix cells
        train_cells=[st.get("train_cells", 1) for st in summary["steps"]],
    )
    if args.eval_every:
        row["held_out"] = held_out(row, args.eval_every, args.instances)
        reached = [t for t, mean in row["held_out"] if mean >= args.target]
        row["target_paced_h"] = (row["elapsed_s"][reached[0] - 1] * scale / 3600
                                 if reached else None)  # fmt: skip
    subprocess.run([sys.executable, "-m", "gyre", "report", str(run_dir)],
                   capture_output=True, check=False)  # fmt: skip
    return row


def per_policy(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        reached = [r.get("target_paced_h") for r in mine]
        out[policy] = {
            "phi": mine[0]["phi"], "mu": mine[0]["mu"],
            "wall_s": statistics.median(r["wall_s"] for r in mine),
            "paced_h": statistics.median(r["paced_h"] for r in mine),
            "paced_h_range": [min(r["paced_h"] for r in mine), max(r["paced_h"] for r in mine)],
            "sim_h": statistics.median(r["sim_h"] for r in mine),
            "sim_error": statistics.median(r["sim_h"] / r["paced_h"] - 1 for r in mine),
            "joined_steps": [r["joined_steps"] for r in mine],
            "reroutes": [r["reroutes"] for r in mine],
            "overrun_share_calls": max(r["overruns"]["calls"]["overrun_share"] for r in mine),
            "overrun_share_cells": max(r["overruns"]["cell_work"]["overrun_share"] for r in mine),
            "target_paced_h": (statistics.median(math.inf if h is None else h for h in reached)
                               if any("target_paced_h" in r for r in mine) else None),
            "held_out_final": [r["held_out"][-1][1] for r in mine if r.get("held_out")],
        }  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(p, config="cluster.yaml", steps=8, staleness=1.5, eval_every=4, target=0.3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds run are FIRST_SEED .. FIRST_SEED+SEEDS-1 (split a study across calls)",
    )
    p.add_argument("--quick", action="store_true", help="one seed, 4 steps")
    args = p.parse_args()
    if args.first_seed < 0 or args.seeds < 1:
        p.error("--first-seed must be >= 0 and --seeds >= 1")
    if args.quick:
        args.seeds, args.steps, args.eval_every = 1, 4, 4
    burst_steps(args)
    base = yaml.safe_load(Path(args.config).read_text())
    with tempfile.TemporaryDirectory(prefix="gyre-cluster-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        rows = [one_run(base, pol, seed, args, work / pol)
                for seed in range(args.first_seed, args.first_seed + args.seeds)
                for pol in POLICIES]  # fmt: skip
    policies = per_policy(rows)
    elastic = policies["elastic"]["paced_h"]
    ratios = {f"{pol}/elastic": policies[pol]["paced_h"] / elastic for pol in POLICIES[1:]}
    if args.json:
        print(json.dumps({"config": args.config, "steps": args.steps, "seeds": args.seeds,
                          "first_seed": args.first_seed,
                          "staleness": args.staleness, "target": args.target,
                          "policies": policies, "ratios": ratios, "runs": rows}, indent=2))  # fmt: skip
        return 0
    print(f"{args.steps} steps x {args.seeds} seeds, E[d] = {args.staleness}, "
          f"{base['topology']['cells']} cells, paced x{base['pace']['scale']:g}")  # fmt: skip
    print(f"{'policy':9} {'phi':>4} {'mu':>3} {'wall_s':>7} {'paced_h':>8} {'range':>13} "
          f"{'sim_h':>7} {'sim err':>8} {'joined':>10} {'to target h':>11}")  # fmt: skip
    for pol, v in policies.items():
        lo, hi = v["paced_h_range"]
        tgt = v["target_paced_h"]
        print(f"{pol:9} {v['phi']:4.1f} {v['mu']:3d} {v['wall_s']:7.1f} {v['paced_h']:8.2f} "
              f"{f'{lo:.2f}-{hi:.2f}':>13} {v['sim_h']:7.2f} {v['sim_error']:+8.1%} "
              f"{v['joined_steps']!s:>10} {'-' if tgt is None else f'{tgt:.2f}':>11}")  # fmt: skip
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x paced time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
