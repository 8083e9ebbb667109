"""Does the default job learn, under every policy? Held-out reward before and after, per seed.

    python tools/bench_learning.py [--config templates/local.yaml] [--steps 40]
                                   [--seeds 0 1 2] [--policies elastic async colocate]
                                   [--staleness 0.5] [--instances 24] [--json] [--keep DIR]
                                   [--target-gain 0.4] [--target-minutes 15]

For each policy and seed: one `gyre run` of the config (the tiny model from its random
init, trained through the whole loop) with `train.seed` = seed and (φ, μ) from
`gyre.schedule.plan_for` at the same expected staleness for every policy (as
tools/bench_policies.py does), then `gyre eval RUN_DIR --initial` on the same held-out task
instances for the initial and the final policy. Reported: held-out reward before / after,
the gain, the training reward of the first and last five steps, and the run's wall time
(coordinator start to finish, process start-up excluded; the eval is not included). The
target: a mean held-out gain >= 0.4 within 15 minutes per run on 2 cores (the tiny model,
templates/local.yaml). For the real model:

    python tools/bench_learning.py --config templates/smollm2.yaml --policies elastic \
        --steps 10 --instances 16 --target-gain 0.2 --target-minutes 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policies import POLICIES, run_policy  # noqa: E402 (one way to run a policy)


def one(base: dict[str, Any], policy: str, seed: int, args: argparse.Namespace,
        work: Path) -> dict[str, Any]:  # fmt: skip
    cfg = json.loads(json.dumps(base))
    cfg["train"]["seed"] = seed
    folder = work / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    row = run_policy(cfg, policy, args.steps, args.staleness, folder, args.min_phi)
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "eval", row["run_dir"], "--initial", "--instances",
         str(args.instances), "--json"], capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{policy} seed {seed}: gyre eval failed:\n{out.stderr[-3000:]}")
    before, after = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
    reward = [s["reward_mean"] for s in summary["steps"]]
    return {
        "policy": policy, "seed": seed, "phi": row["phi"], "mu": row["mu"],
        "wall_s": row["wall_s"], "before": before["mean"], "after": after["mean"],
        "gain": after["mean"] - before["mean"], "before_std": before["std"],
        "after_std": after["std"], "train_first5": sum(reward[:5]) / 5,
        "train_last5": sum(reward[-5:]) / 5, "no_signal_steps": summary["no_signal_steps"],
        "eval_s": before["wall_s"] + after["wall_s"], "run_dir": row["run_dir"],
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "templates" / "local.yaml"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--staleness", type=float, default=0.5, help="target E[d] for all policies")
    p.add_argument("--min-phi", type=float, default=0.5, help="Elastic's smallest φ")
    p.add_argument("--instances", type=int, default=24, help="held-out instances per eval")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="keep the runs under DIR")
    p.add_argument("--target-gain", type=float, default=0.4, help="mean held-out gain wanted")
    p.add_argument("--target-minutes", type=float, default=15.0, help="... within this wall time")
    args = p.parse_args()
    base = yaml.safe_load(Path(args.config).read_text())
    with tempfile.TemporaryDirectory(prefix="gyre-learn-") as tmp:
        work = Path(args.keep or tmp)
        rows = [one(base, pol, seed, args, work / pol) for pol in args.policies
                for seed in args.seeds]  # fmt: skip
    means = {}
    for pol in args.policies:
        mine = [r for r in rows if r["policy"] == pol]
        means[pol] = {k: statistics.fmean(r[k] for r in mine)
                      for k in ("before", "after", "gain", "wall_s")}  # fmt: skip
        walls = [r["wall_s"] for r in mine]
        means[pol].update(gain_sd=statistics.pstdev(r["gain"] for r in mine),
                          wall_s_range=[min(walls), max(walls)])  # fmt: skip
    if args.json:
        print(json.dumps({"steps": args.steps, "staleness": args.staleness, "runs": rows,
                          "means": means}, indent=2))  # fmt: skip
        return 0
    print(f"{args.steps} steps, E[d] = {args.staleness}, {args.instances} held-out instances")
    print(f"{'policy':9} {'seed':>4} {'before':>7} {'after':>7} {'gain':>6} {'train 1-5':>9} "
          f"{'last 5':>7} {'wall_s':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['policy']:9} {r['seed']:4d} {r['before']:7.3f} {r['after']:7.3f} "
              f"{r['gain']:+6.3f} {r['train_first5']:9.3f} {r['train_last5']:7.3f} "
              f"{r['wall_s']:7.0f}")  # fmt: skip
    for pol, m in means.items():
        ok = m["gain"] >= args.target_gain and m["wall_s"] <= 60 * args.target_minutes
        print(f"{pol}: mean held-out {m['before']:.3f} -> {m['after']:.3f} ({m['gain']:+.3f} "
              f"± {m['gain_sd']:.3f} sd over seeds), {m['wall_s']:.0f} s per run "
              f"({m['wall_s_range'][0]:.0f}-{m['wall_s_range'][1]:.0f}) — target gain >= {args.target_gain} within "
              f"{args.target_minutes:g} min: {'met' if ok else 'missed'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
