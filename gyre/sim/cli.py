"""`gyre sim`: simulate Elastic, Async and Colocate on a workload template.

gyre sim templates/sim/nl2repo.yaml --policy all --steps 48 --seed 0
gyre sim templates/sim/nl2repo.yaml --staleness 1 --json
gyre sim --ablation E0            # one Table 1 configuration
gyre sim --ablation table1        # all of them, normalized to E0 beside the paper
gyre sim CONFIG --timeline out.json   # role timeline + per-step times for plotting
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate scheduling policies on a workload template")
    p.add_argument("config", nargs="?", help="simulation template (YAML)")
    p.add_argument("--policy", help="elastic, async, colocate or all (default: the template's)")
    p.add_argument("--steps", type=int, help="training steps S")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument("--staleness", type=float, help="target E[d]: (φ, μ) per policy from gyre plan")
    p.add_argument("--ablation", help="Table 1 configuration (A0-A3, C0-C3, E0-E2) or table1")
    p.add_argument("--timeline", help="write per-run timelines and step times to this JSON file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gyre.errors import ConfigError

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"steps: {args.steps}; allowed >= 1")
    if args.ablation:
        return _ablation(args)
    if not args.config:
        raise ConfigError("config: missing; give a template path or --ablation NAME")
    return _simulate(args)


def _simulate(args: argparse.Namespace) -> int:
    from gyre.schedule.config import POLICIES
    from gyre.sim.config import check_policy, load_sim_config
    from gyre.sim.report import table, to_json
    from gyre.sim.simulator import Simulator

    cfg = load_sim_config(args.config)
    if args.staleness is not None:
        cfg = dataclasses.replace(cfg, staleness=args.staleness)
    name = args.policy or cfg.policy
    check_policy(name, allow_all=True, key="--policy")
    names = POLICIES if name == "all" else (name,)
    results = [Simulator(cfg, n, steps=args.steps, seed=args.seed).run() for n in names]
    _write_timeline(args.timeline, results)
    print(json.dumps(to_json(results), indent=2) if args.json else table(results))
    return 0


def _ablation(args: argparse.Namespace) -> int:
    from gyre.sim.ablation import format_table1, run_ablation, run_table1
    from gyre.sim.report import table, to_json

    if args.ablation == "table1":
        rows = run_table1(args.steps, args.seed)
        _write_timeline(args.timeline, [r for _, r, _, _ in rows])
        if args.json:
            out = {
                n: {"total_h": r.total_h, "over_e0": x, "paper_over_e0": p} for n, r, x, p in rows
            }
            print(json.dumps(out, indent=2))
        else:
            print(format_table1(rows))
        return 0
    result = run_ablation(args.ablation, args.steps, args.seed)
    _write_timeline(args.timeline, [result])
    print(json.dumps(to_json([result]), indent=2) if args.json else table([result]))
    return 0


def _write_timeline(path: str | None, results: list) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump([r.to_dict(timeline=True) for r in results], f)
    print(f"timeline written to {path}", file=sys.stderr)
