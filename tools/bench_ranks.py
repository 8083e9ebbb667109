"""CPU each rank of a real `gyre run` burns, per minute of run: do idle ranks cost nothing?

    python tools/bench_ranks.py [--config templates/bench/policies.yaml] [--steps 6] [--json]

Runs the job and samples every rank's user and system CPU time (/proc/PID/stat) from the
moment the first optimizer step is reported until the run ends, so start-up (imports, model
loading) is left out. On the policy benchmark's latency-bound workload the coordinator, the
proxy node and the cells spend most of the steady state waiting; the number to watch is a
waiting rank's CPU seconds per minute (goal: at most 5% of a core, 3 CPU-s per minute).
Engines (the cells' child processes) are reported separately: they do the decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLES = {0: "coordinator", 1: "proxy node"}
TICK = os.sysconf("SC_CLK_TCK")


def _processes(run_dir: Path) -> dict[str, int]:
    """name -> pid of the run's ranks (by PMI_RANK) and engines (by GYRE_ENGINE_INDEX)."""
    out = {}
    mark = str(run_dir).encode()
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            cmd = Path(e.path, "cmdline").read_bytes()
            env = dict(kv.split(b"=", 1) for kv in Path(e.path, "environ").read_bytes().split(b"\0")
                       if b"=" in kv)  # fmt: skip
        except OSError:
            continue
        if b"gyre.runtime.main" in cmd and mark in cmd and b"PMI_RANK" in env:
            r = int(env[b"PMI_RANK"])
            out[f"rank {r} ({ROLES.get(r, f'cell {r - 2}')})"] = int(e.name)
        elif b"gyre.rollout.cli" in cmd and env.get(b"GYRE_RUN_DIR", b"").endswith(mark):
            out[f"engine {int(env[b'GYRE_ENGINE_INDEX'])}"] = int(e.name)
    return out


def _cpu(pid: int) -> tuple[float, float] | None:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(f[11]) / TICK, int(f[12]) / TICK


def _first_step(run_dir: Path) -> bool:
    log = run_dir / "job.log"
    return log.exists() and '"step": 1' in log.read_text(errors="replace")


def measure(config: Path, steps: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="gyre-ranks-") as tmp:
        cfg = yaml.safe_load(config.read_text())
        cfg["steps"], cfg["runs_dir"] = steps, tmp
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run_dir = Path(tmp) / "run"
        proc = subprocess.Popen([sys.executable, "-m", "gyre", "run", str(path), "--run-dir",
                                 str(run_dir), "--quiet"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=os.getcwd())  # fmt: skip
        while not _first_step(run_dir):
            if proc.poll() is not None:
                raise SystemExit("the run ended before its first step")
            time.sleep(0.2)
        pids = _processes(run_dir)
        start = {n: _cpu(p) for n, p in pids.items()}
        t0, last = time.time(), dict(start)
        while proc.poll() is None:  # keep the latest reading of each (they exit at the end)
            for n, p in pids.items():
                now = _cpu(p)
                if now is not None:
                    last[n] = now
            time.sleep(0.5)
        minutes = (time.time() - t0) / 60
    out = {}
    for n in sorted(pids):
        a, b = start[n], last[n]
        if a is None or b is None:
            continue
        user, system = (b[0] - a[0]) / minutes, (b[1] - a[1]) / minutes
        out[n] = {"user_s_per_min": user, "system_s_per_min": system,
                  "cpu_s_per_min": user + system, "core_share": (user + system) / 60}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "templates" / "bench" / "policies.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = measure(Path(args.config), args.steps)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for n, r in out.items():
        print(f"{n:22} {r['cpu_s_per_min']:6.2f} CPU-s per minute ({r['core_share']:.1%} of a "
              f"core; user {r['user_s_per_min']:.2f}, system {r['system_s_per_min']:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
