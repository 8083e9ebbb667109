"""Benchmark and report of the simulator on the NL2RepoBench-like template.

Runs 48 steps of Elastic, Async and Colocate at E[d] = 1 and 1.5 and prints total hours, the
speedups beside the paper's (§6.2: 1.42-1.53x over Async, 1.36-1.47x over Colocate) and the
wall time of each run (target: a 48-step, 32-node run, ~25k executions, in <= 10 s on one
core); then Table 1 (12 steps, E[d] = 1.5) normalized to E0 beside the paper.

    OMP_NUM_THREADS=1 python tools/bench_sim.py [--seed N] [--no-table1]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from gyre.sim import Simulator, load_sim_config
from gyre.sim.ablation import format_table1, run_table1

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "sim" / "nl2repo.yaml"
PAPER = {"async": "1.42-1.53", "colocate": "1.36-1.47"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--no-table1", action="store_true")
    args = parser.parse_args()
    base = load_sim_config(TEMPLATE)
    for staleness in (1.0, 1.5):
        cfg = dataclasses.replace(base, staleness=staleness)
        runs = {
            p: Simulator(cfg, p, steps=args.steps, seed=args.seed).run()
            for p in ("elastic", "async", "colocate")
        }
        e = runs["elastic"].total_h
        print(f"E[d] = {staleness}, {args.steps} steps, seed {args.seed}")
        for p, r in runs.items():
            ratio = f"{r.total_h / e:.2f}x (paper {PAPER[p]}x)" if p in PAPER else ""
            print(
                f"  {p:<9} φ={r.phi:<4} μ={r.mu}  {r.total_h:7.2f} h  E[d]={r.mean_staleness:.2f}"
                f"  ideal {r.ideal_h:6.2f} h  util {r.utilization:.0%}  {r.executions} executions"
                f"  wall {r.wall_s:.2f} s  {ratio}"
            )
    if not args.no_table1:
        print("\nTable 1 (12 steps, E[d] = 1.5):")
        print(format_table1(run_table1(seed=args.seed)))


if __name__ == "__main__":
    main()
