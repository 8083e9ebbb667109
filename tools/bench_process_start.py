"""CPU seconds it costs to start each kind of process a run starts many of.

    python tools/bench_process_start.py [--repeat 5] [--json]

A 40-step `gyre run` launches ~320 harness processes and every world start launches its
ranks and engines; on 2 cores their start-up is CPU the run cannot spend on its work. Each
row starts a fresh interpreter `--repeat` times and reports the user + system CPU of the
child (mean and standard deviation):

* `agent imports` — what `python -m gyre.harness.reference_agent` imports before its first
  call (its HTTP client is the standard library's);
* `openai SDK` — importing the `openai` package and building a client, what every agent
  launch paid while the reference agent used the SDK;
* `engine start` — `python -m gyre.rollout.cli --model tiny` until it prints its URL (torch,
  transformers' Qwen2, the tiny model, the tokenizer), then SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys

CASES = {
    "agent imports": [sys.executable, "-c", "import gyre.harness.reference_agent"],
    "openai SDK": [sys.executable, "-c",
                   "import openai; openai.OpenAI(api_key='k', base_url='http://127.0.0.1:9/v1')"],
    "engine start": [sys.executable, "-m", "gyre.rollout.cli", "--model", "tiny", "--host",
                     "127.0.0.1", "--port", "0", "--threads", "1"],
}  # fmt: skip


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_of(cmd: list[str]) -> float:
    """CPU seconds of one start (a server is stopped once it prints its URL)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    before = _children_cpu()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            text=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            proc.send_signal(signal.SIGTERM)
            break
    if proc.wait(timeout=120) not in (0, -signal.SIGTERM):
        raise SystemExit(f"{cmd}: exit {proc.returncode}")
    return _children_cpu() - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = {}
    for name, cmd in CASES.items():
        cpu = [cpu_of(cmd) for _ in range(args.repeat)]
        rows[name] = {"mean_s": statistics.mean(cpu), "sd_s": statistics.pstdev(cpu), "n": len(cpu)}
        if not args.json:
            print(f"{name:14s} {rows[name]['mean_s']:6.2f} ± {rows[name]['sd_s']:.2f} CPU-s "
                  f"(n={len(cpu)})", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
