"""Elastic vs Async vs Colocate on the real runtime: the same workload, wall time side by side.

    python tools/bench_policies.py [--config templates/bench/policies.yaml] [--steps 12]
                                   [--staleness 1.0] [--json] [--keep DIR]

Each policy runs `gyre run` (one MPI world: coordinator, proxy node with the harness pool,
cells) on the same config, the same cell count and the same task draw, with (φ, μ) chosen by
`gyre.schedule.plan_for` so that every policy has the same expected staleness
E[d] = φ + (μ-1)/2. Steps must be a multiple of every policy's μ. Reported per policy: the
coordinator's wall time for S steps (process start-up excluded), mean staleness, switches
(and wasted ones: satellites that trained nothing), switch seconds per direction, reroutes;
and the ratios async/elastic and colocate/elastic (> 1: elastic is faster), for the whole
wall time and for the steady state: seconds per step after the first burst every policy
completes (the lcm of the μs), which leaves out start-up and the pipeline fill, as an
hours-long run would (its steps are mostly steady). With `--eval-every K` the policy
each run had published by step K, 2K, ... and its final one are evaluated on held-out
instances (`gyre.runtime.evaluation`, the code `gyre eval` runs) and the time each policy
takes to reach `--target` held-out reward is compared too.
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
    cfg["train"]["keep_policies"] = steps  # every publication kept, for the held-out evals
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
        "wasted_switches": summary["wasted_switches"], "reroutes": summary["reroutes"],
        "switch_s": _switch_seconds(run_dir), "run_dir": str(run_dir),
        "elapsed_s": [st["elapsed_s"] for st in summary["steps"]],
        "reward": [st["reward_mean"] for st in summary["steps"]],
    }  # fmt: skip


def _switch_seconds(run_dir: Path) -> dict[str, float]:
    """Mean seconds of the whole transition, per direction (the `switch` events)."""
    from gyre.trajectory.reader import TraceReader

    with TraceReader(run_dir / "trace.h5") as r:
        rows = [json.loads(e["detail"]) for e in r.rows("events") if e["kind"] == "switch"]
    out = {}
    for to in ("train", "rollout"):
        got = [d["seconds"] for d in rows if d["to"] == to]
        if got:
            out[to] = sum(got) / len(got)
    return out


def held_out(row: dict[str, Any], every: int, instances: int) -> list[tuple[int, float]]:
    """(step, held-out reward) every `every` steps and at the end: at step t, the newest
    policy the run had published by then (Colocate publishes every μ-th step only)."""
    from gyre.runtime.evaluation import Target, evaluate
    from gyre.runtime.shared import policies
    from gyre.runtime.shared.config import load_run_config

    run_dir = Path(row["run_dir"])
    cfg = load_run_config(run_dir / "config.yaml")
    steps = len(row["elapsed_s"])
    kept = [*policies.published(run_dir), (steps, run_dir / policies.POLICIES / "final")]
    out = []
    for t in sorted({*range(every, steps + 1, every), steps}):
        v, d = max((v, d) for v, d in kept if v <= t)
        res = evaluate(cfg, Target(d.name, str(d), v), run_dir / "eval" / f"step{t}",
                       tasks=cfg.harness.tasks, instances=instances,
                       concurrency=cfg.engine.max_batch_size)  # fmt: skip
        out.append((t, res.mean))
    return out


def time_to(row: dict[str, Any], target: float) -> float | None:
    """Seconds of run until the first evaluated step whose policy is at or above `target`."""
    for t, mean in row.get("held_out", []):
        if mean >= target:
            return float(row["elapsed_s"][t - 1])
    return None


def steady(row: dict[str, Any], first: int) -> float | None:
    """Seconds per step after the first `first` steps (start-up and pipeline fill excluded)."""
    done = row["elapsed_s"]
    if len(done) <= first:
        return None
    return (done[-1] - done[first - 1]) / (len(done) - first)


def study_arguments(
    p: argparse.ArgumentParser,
    *,
    config: str,
    steps: int,
    staleness: float,
    eval_every: int,
    target: float,
) -> None:
    """The options of a study of the three policies (this benchmark's, bench_cluster's), with
    the study's defaults."""
    p.add_argument("--config", default=str(ROOT / "templates" / "bench" / config))
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument(
        "--staleness", type=float, default=staleness, help="target E[d] for all policies"
    )
    p.add_argument(
        "--min-phi",
        type=float,
        default=1.0,
        help="Elastic's smallest φ (gyre plan --min-phi); 1.0 gives μ = 1 at E[d] = 1, "
        "a publication per step, which is cheap on one machine",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=eval_every,
        help="evaluate the policy of every K-th step on held-out instances (0: no evals)",
    )
    p.add_argument("--target", type=float, default=target, help="held-out reward to reach")
    p.add_argument("--instances", type=int, default=8, help="held-out instances per eval")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="keep the runs (traces, summaries) under DIR")


def burst_steps(args: argparse.Namespace) -> int:
    """The lcm of every policy's μ: the first burst every policy completes, which `--steps`
    must be a multiple of."""
    from gyre.schedule import plan_for

    mus = [plan_for(pol, args.staleness, args.min_phi).mu for pol in POLICIES]
    lcm = math.lcm(*mus)
    if args.steps % lcm:
        raise SystemExit(f"--steps {args.steps}: must be a multiple of every policy's μ ({mus})")
    return lcm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(p, config="policies.yaml", steps=12, staleness=1.0, eval_every=0, target=0.5)
    args = p.parse_args()
    lcm = burst_steps(args)
    base = yaml.safe_load(Path(args.config).read_text())
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        rows = [run_policy(base, pol, args.steps, args.staleness, Path(args.keep), args.min_phi)
                for pol in POLICIES]  # fmt: skip
    else:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
            rows = [run_policy(base, pol, args.steps, args.staleness, Path(tmp), args.min_phi)
                    for pol in POLICIES]  # fmt: skip
    if args.eval_every:
        for r in rows:
            r["held_out"] = held_out(r, args.eval_every, args.instances)
            r["time_to_target_s"] = time_to(r, args.target)
    elastic = rows[0]["wall_s"]
    ratios = {f"{r['policy']}/elastic": r["wall_s"] / elastic for r in rows[1:]}
    for r in rows:  # steady state: from the end of the first burst every policy completes
        r["steady_s_per_step"] = steady(r, lcm)
    steady_ratios = {}
    if rows[0]["steady_s_per_step"]:
        steady_ratios = {f"{r['policy']}/elastic": r["steady_s_per_step"] / rows[0]["steady_s_per_step"]
                         for r in rows[1:]}  # fmt: skip
    target_ratios = {}
    if args.eval_every and rows[0].get("time_to_target_s"):
        target_ratios = {f"{r['policy']}/elastic": (r["time_to_target_s"] or float("inf"))
                         / rows[0]["time_to_target_s"] for r in rows[1:]}  # fmt: skip
    if args.json:
        print(json.dumps({"steps": args.steps, "staleness": args.staleness, "runs": rows,
                          "ratios": ratios, "steady_ratios": steady_ratios,
                          "time_to_target_ratios": target_ratios}, indent=2))  # fmt: skip
        return 0
    print(f"{args.steps} steps, target E[d] = {args.staleness}, cells = "
          f"{base['topology']['cells']}")  # fmt: skip
    print(f"{'policy':10} {'phi':>5} {'mu':>3} {'wall_s':>8} {'steady_s':>8} {'E[d]':>6} "
          f"{'switches':>8} {'wasted':>6} {'to_train_s':>10} {'to_roll_s':>9} {'reroutes':>8}")  # fmt: skip
    for r in rows:
        st = r["steady_s_per_step"]
        sw = r["switch_s"]
        print(f"{r['policy']:10} {r['phi']:5.2f} {r['mu']:3d} {r['wall_s']:8.1f} "
              f"{'-' if st is None else f'{st:.1f}':>8} {r['staleness_mean']:6.2f} "
              f"{r['switches']:8d} {r['wasted_switches']:6d} {sw.get('train', 0):10.2f} "
              f"{sw.get('rollout', 0):9.2f} {r['reroutes']:8d}")  # fmt: skip
        if "held_out" in r:
            print(f"  held-out {r['held_out']}, time to {args.target}: {r['time_to_target_s']}")
    for name, value in ratios.items():
        line = f"{name}: {value:.2f}x wall"
        if name in steady_ratios:
            line += f", {steady_ratios[name]:.2f}x steady (steps {lcm + 1}..{args.steps})"
        if name in target_ratios:
            line += f", {target_ratios[name]:.2f}x time to held-out reward {args.target}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
