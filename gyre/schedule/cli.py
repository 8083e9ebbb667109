"""`gyre plan --staleness`: (φ, μ) per placement policy for a target mean scheduling staleness.

    gyre plan --staleness 1.5          # table
    gyre plan --staleness 1 --json     # machine-readable

Uses E[d] = φ + (μ-1)/2 with the paper's conventions (Async μ = 1, Colocate φ = 0);
see gyre/schedule/plan.py for Elastic's rule. The `plan` command itself is registered by
`gyre.runtime.cli`, which adds `--memory CONFIG` (a run config's memory per rank) beside
these arguments.
"""

from __future__ import annotations

import argparse
import json

from gyre import cliargs


def add_arguments(p: argparse.ArgumentParser, target: argparse._ActionsContainer) -> None:
    """`--staleness E` into `target` (a group of `p`: one of plan's targets), and its
    options into `p`."""
    target.add_argument(
        "--staleness",
        type=cliargs.nonnegative_float,
        metavar="E",
        help="target E[d]: (φ, μ) per policy",
    )
    p.add_argument(
        "--min-phi", type=float, default=0.5, help="Elastic's minimum extra dispatch (batches)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from gyre.schedule.plan import plan

    plans = plan(args.staleness, args.min_phi)
    if args.json:
        rows = [{"policy": p.policy, "phi": p.phi, "mu": p.mu} for p in plans]
        print(json.dumps({"staleness": args.staleness, "plans": rows}))
        return 0
    print(f"E[d] = φ + (μ-1)/2 = {args.staleness:g}")
    print(f"{'policy':<10}{'φ':>7}{'μ':>4}")
    for p in plans:
        print(f"{p.policy:<10}{p.phi:>7.3g}{p.mu:>4}")
    if len(plans) < 3:
        print("colocate: none (needs φ = 0 and a whole μ = 2E[d]+1; use E[d] in steps of 0.5)")
    return 0
