"""Elastic vs Async vs Colocate on the real runtime: the same workload, wall time side by side.

    python tools/bench_policies.py [--config templates/bench/policies.yaml] [--steps 12]
                                   [--staleness 1.0] [--json] [--keep DIR]

Each policy runs `gyre run` (one MPI world: coordinator, proxy node with the harness pool,
cells) on the same config, the same cell count and the same task draw, with (φ, μ) chosen by
`gyre.schedule.plan_for` so that every policy has the same expected staleness
E[d] = φ + (μ-1)/2. Steps must be a multiple of every policy's μ. Reported per policy: the
coordinator's wall time for S steps (process start-up excluded), mean staleness, switches,
reroutes; and the ratios async/elastic and colocate/elastic (> 1: elastic is faster), for
the whole wall time and for the steady state: seconds per step after the first burst every
policy completes (the lcm of the μs), which leaves out start-up and the pipeline fill, as
an hours-long run would (its steps are mostly steady).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("elastic", "async", "colocate")


def run_policy(base: dict[str, Any], policy: str, steps: int, staleness: float,
               work: Path, min_phi: float) -> dict[str, Any]:  # fmt: skip
    from gyre.schedule import plan_for

    plan = plan_for(policy, staleness, min_phi)
    cfg = json.loads(json.dumps(base))
    cfg["steps"] = steps
    cfg["schedule"].update(policy=policy, phi=plan.phi, mu=plan.mu)
    cfg["runs_dir"] = str(work / "runs")
    path = work / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = work / policy
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", str(path), "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{policy}: gyre run failed:\n{out.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    stale = [s["staleness_mean"] for s in summary["steps"]]
    return {
        "policy": policy, "phi": plan.phi, "mu": plan.mu, "wall_s": summary["wall_s"],
        "staleness_mean": sum(stale) / len(stale), "switches": summary["switches"],
        "reroutes": summary["reroutes"], "run_dir": str(run_dir),
        "elapsed_s": [st["elapsed_s"] for st in summary["steps"]],
    }  # fmt: skip


def steady(row: dict[str, Any], first: int) -> float | None:
    """Seconds per step after the first `first` steps (start-up and pipeline fill excluded)."""
    done = row["elapsed_s"]
    if len(done) <= first:
        return None
    return (done[-1] - done[first - 1]) / (len(done) - first)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "templates" / "bench" / "policies.yaml"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--staleness", type=float, default=1.0, help="target E[d] for all policies")
    p.add_argument("--min-phi", type=float, default=1.0,
                   help="Elastic's smallest φ (gyre plan --min-phi); 1.0 gives μ = 1 at E[d] = 1, "
                        "a publication per step, which is cheap on one machine")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="keep the runs (traces, summaries) under DIR")
    args = p.parse_args()
    from gyre.schedule import plan_for

    mus = [plan_for(pol, args.staleness, args.min_phi).mu for pol in POLICIES]
    lcm = math.lcm(*mus)
    if args.steps % lcm:
        raise SystemExit(f"--steps {args.steps}: must be a multiple of every policy's μ ({mus})")
    base = yaml.safe_load(Path(args.config).read_text())
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        rows = [run_policy(base, pol, args.steps, args.staleness, Path(args.keep), args.min_phi)
                for pol in POLICIES]  # fmt: skip
    else:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
            rows = [run_policy(base, pol, args.steps, args.staleness, Path(tmp), args.min_phi)
                    for pol in POLICIES]  # fmt: skip
    elastic = rows[0]["wall_s"]
    ratios = {f"{r['policy']}/elastic": r["wall_s"] / elastic for r in rows[1:]}
    for r in rows:  # steady state: from the end of the first burst every policy completes
        r["steady_s_per_step"] = steady(r, lcm)
    steady_ratios = {}
    if rows[0]["steady_s_per_step"]:
        steady_ratios = {f"{r['policy']}/elastic": r["steady_s_per_step"] / rows[0]["steady_s_per_step"]
                         for r in rows[1:]}  # fmt: skip
    if args.json:
        print(json.dumps({"steps": args.steps, "staleness": args.staleness, "runs": rows,
                          "ratios": ratios, "steady_ratios": steady_ratios}, indent=2))  # fmt: skip
        return 0
    print(f"{args.steps} steps, target E[d] = {args.staleness}, cells = "
          f"{base['topology']['cells']}")  # fmt: skip
    print(f"{'policy':10} {'phi':>5} {'mu':>3} {'wall_s':>8} {'steady_s':>8} {'E[d]':>6} "
          f"{'switches':>8} {'reroutes':>8}")  # fmt: skip
    for r in rows:
        st = r["steady_s_per_step"]
        print(f"{r['policy']:10} {r['phi']:5.2f} {r['mu']:3d} {r['wall_s']:8.1f} "
              f"{'-' if st is None else f'{st:.1f}':>8} {r['staleness_mean']:6.2f} "
              f"{r['switches']:8d} {r['reroutes']:8d}")  # fmt: skip
    for name, value in ratios.items():
        line = f"{name}: {value:.2f}x wall"
        if name in steady_ratios:
            line += f", {steady_ratios[name]:.2f}x steady (steps {lcm + 1}..{args.steps})"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
