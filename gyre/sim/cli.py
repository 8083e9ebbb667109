"""`gyre sim`: simulate Elastic, Async and Colocate on a workload template or a recorded run.

gyre sim templates/sim/nl2repo.yaml --policy all --steps 48 --seed 0
gyre sim templates/sim/nl2repo.yaml --staleness 1 --json
gyre sim --ablation E0            # one Table 1 configuration
gyre sim --ablation table1        # all of them, normalized to E0 beside the paper
gyre sim CONFIG --timeline out.json   # role timeline + per-step times for plotting
gyre sim CONFIG scheduler.cells=4 workload.harness_timeout_h=2   # KEY.PATH=VALUE overrides
gyre sim CONFIG --sweep cells=4,8 --sweep standalone_nodes=0,4 [--plot sweep.png] [--json]
gyre sim --replay runs/x [scheduler.cells=6] [--policy all]   # fit a recorded run, replay it

CONFIG is a sim template (templates/sim/); a run config is refused with the template to use
(it has no workload: --replay fits one from a run made with it). Overrides follow CONFIG
(or --replay); values are YAML and go through the same strict loader as the file. Sweep
keys: gyre/sim/sweep.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from gyre import cliargs

PLANNING_KEYS = ("cells", "nodes_per_cell", "standalone_nodes", "concurrency_per_cell", "phi",
                 "mu", "phi_mu", "staleness")  # fmt: skip
"""The sweep keys of gyre/sim/sweep.py's table (here, so `gyre --help` stays light); any
other key is a dotted template path."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate scheduling policies on a workload template")
    p.add_argument("config", nargs="?",
                   help="simulation template (YAML, e.g. templates/sim/nl2repo.yaml); a run "
                   "config has no workload to simulate: --replay RUN_DIR of a run made with it")  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                   help="set template keys (after CONFIG), e.g. scheduler.cells=4")  # fmt: skip
    p.add_argument("--policy", help="elastic, async, colocate or all (default: the template's)")
    p.add_argument("--steps", type=cliargs.count, help="training steps S")
    p.add_argument("--seed", type=cliargs.size, help="workload seed")
    p.add_argument(
        "--staleness",
        type=cliargs.nonnegative_float,
        help="target E[d]: (φ, μ) per policy from gyre plan",
    )
    p.add_argument("--ablation", help="Table 1 configuration (A0-A3, C0-C3, E0-E2) or table1")
    p.add_argument("--replay", metavar="RUN_DIR|TRACE",
                   help="fit the workload and costs of a recorded run and simulate them")  # fmt: skip
    p.add_argument("--in-order", action="store_true",
                   help="replay: the recorded groups in the run's dispatch order, not drawn "
                   "with replacement (one replay: no draw to average)")  # fmt: skip
    p.add_argument("--seeds", type=cliargs.count, default=5,
                   help="replay: seeds to average the recorded groups' draws over (default 5)")  # fmt: skip
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"what-if sweep over KEY ({', '.join(PLANNING_KEYS)} or a KEY.PATH); "
                   "repeat for a grid")  # fmt: skip
    p.add_argument(
        "--plot",
        type=cliargs.output_file,
        default="sweep.png",
        help="sweep: plot file (default sweep.png)",
    )
    p.add_argument(
        "--jobs", type=cliargs.count, help="sweep: processes to run points in (default: CPUs)"
    )
    p.add_argument(
        "--timeline",
        type=cliargs.output_file,
        help="write per-run timelines and step times to this JSON file",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gyre.errors import ConfigError

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"steps: {args.steps}; allowed >= 1")
    if args.ablation:
        if args.config or args.overrides or args.replay or args.sweep:
            raise ConfigError("--ablation runs a built-in configuration; allowed without "
                              "CONFIG, overrides, --replay and --sweep")  # fmt: skip
        return _ablation(args)
    if args.in_order and not args.replay:
        raise ConfigError("--in-order: replays a recorded run's groups; give --replay RUN too")
    if args.replay:
        if args.config:  # `gyre sim --replay RUN key=v`: argparse puts the first override here
            args.overrides = [args.config, *args.overrides]
        return _replay(args)
    if not args.config:
        raise ConfigError("config: missing; give a template path, --replay RUN or --ablation NAME")
    if "=" in args.config:
        raise ConfigError(f"config: {args.config!r} looks like an override; give CONFIG first")
    data = _template(args.config, args.overrides)
    if args.sweep:
        return _sweep(args, data, Path(args.config).stem)
    return _simulate(args, data, Path(args.config).stem)


def _template(path: str, overrides: list[str]) -> dict[str, Any]:
    from gyre.config import apply_overrides
    from gyre.errors import ConfigError
    from gyre.sim.config import read_template

    p = Path(path)
    if p.is_dir() or p.suffix in (".h5", ".hdf5"):
        raise ConfigError(f"config: {path} is a run or trace, not a template; use --replay {path}")
    try:
        return apply_overrides(read_template(p), overrides)
    except UnicodeDecodeError:
        raise ConfigError(f"config: {path} is not a YAML template (binary content)") from None


def _simulate(args: argparse.Namespace, data: dict[str, Any], name: str, groups: Any = None) -> int:
    from gyre.config import load
    from gyre.schedule.config import POLICIES
    from gyre.sim.config import SimConfig, check_policy
    from gyre.sim.report import table, to_json
    from gyre.sim.simulator import Simulator

    cfg = load(SimConfig, data, path=name)
    if args.staleness is not None:
        cfg = dataclasses.replace(cfg, staleness=args.staleness)
    policy = args.policy or cfg.policy
    check_policy(policy, allow_all=True, key="--policy")
    names = POLICIES if policy == "all" else (policy,)
    results = [Simulator(cfg, n, steps=args.steps, seed=args.seed, groups=groups).run()
               for n in names]  # fmt: skip
    _write_timeline(args.timeline, results)
    print(json.dumps(to_json(results), indent=2) if args.json else table(results))
    return 0


def _sweep(args: argparse.Namespace, data: dict[str, Any], name: str, groups: Any = None) -> int:
    from gyre.sim.config import check_policy
    from gyre.sim.sweep import parse_sweeps, plot, policies_for, run_sweep, table, to_json

    if args.staleness is not None:
        data = {**data, "staleness": args.staleness}
    policy = args.policy or str(data.get("policy", "all"))
    check_policy(policy, allow_all=True, key="--policy")

    def simulate(runs: list[tuple[Any, str]]) -> list[Any]:
        jobs = [(cfg, p, args.steps, args.seed, groups) for cfg, p in runs]
        workers = min(len(jobs), os.cpu_count() or 1, args.jobs or len(jobs))
        if workers <= 1:
            return [_run_one(*job) for job in jobs]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(_run_one, *zip(*jobs)))

    points = run_sweep(data, parse_sweeps(args.sweep), policies_for(policy), simulate, name)
    _write_timeline(args.timeline, [pt.result for pt in points])
    written = plot(points, args.plot) if args.plot else None
    if args.json:
        print(json.dumps({**to_json(points), "plot": str(written) if written else None}, indent=2))
    else:
        print(table(points))
        if written:
            print(f"plot written to {written}", file=sys.stderr)
    return 0


def _run_one(cfg: Any, policy: str, steps: int | None, seed: int | None, groups: Any) -> Any:
    from gyre.sim.simulator import Simulator

    return Simulator(cfg, policy, steps=steps, seed=seed, groups=groups).run()


def _replay(args: argparse.Namespace) -> int:
    from gyre.config import apply_overrides, load
    from gyre.errors import ConfigError
    from gyre.sim.config import SimConfig, check_policy
    from gyre.sim.replay import fit, format_replay, read_run
    from gyre.sim.simulator import Simulator

    recorded = read_run(args.replay)
    f = fit(recorded)
    data = apply_overrides(f.template, args.overrides)
    cfg = load(SimConfig, data, path="replay")
    same_groups = cfg.scheduler.executions_per_group == recorded.executions_per_group
    groups = f.groups if same_groups else None  # other N: the parametric fit
    if args.in_order and (args.sweep or args.overrides or args.staleness is not None
                          or (args.policy or cfg.policy) != cfg.policy):  # fmt: skip
        raise ConfigError("--in-order: replays the run as it ran; allowed without overrides, "
                          "--policy, --staleness and --sweep")  # fmt: skip
    if args.sweep:
        return _sweep(args, data, "replay", groups)
    policy = args.policy or cfg.policy
    check_policy(policy, allow_all=True, key="--policy")
    if policy != cfg.policy or args.overrides or args.staleness is not None:
        return _simulate(args, data, "replay", groups)  # another topology on the fit
    seeds = [args.seed] if args.seed is not None else list(range(max(1, args.seeds)))
    order = args.in_order and groups is not None
    replays = [
        Simulator(cfg, policy, steps=args.steps, seed=s, groups=groups, in_order=order).run()
        for s in (seeds[:1] if order else seeds)
    ]
    fitted = [Simulator(cfg, policy, steps=args.steps, seed=s).run() for s in seeds]
    _write_timeline(args.timeline, replays)
    if args.json:
        walls = [r.total_h * 3600 for r in replays]
        print(json.dumps({"template": f.template, "recorded": f.recorded,
                          "replay_wall_s": walls, "fit_wall_s": [r.total_h * 3600 for r in fitted],
                          "error": sum(walls) / len(walls) / f.recorded["wall_s"] - 1},
                         indent=2))  # fmt: skip
    else:
        print(format_replay(f, replays, fitted))
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
