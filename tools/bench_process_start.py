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
  transformers' Qwen2, the tiny model, the tokenizer), then SIGTERM;
* `bwrap sandbox` (where bubblewrap runs) — `/bin/true` in the sandbox of one execution of the
  `learn` suite, as the runner builds it (`sandbox.allow_list`, `bwrap_argv`; the copy of
  /etc it binds found or made before the first start), and `bwrap sandbox, /etc carved`
  with /etc's ~140 entries bound one by one instead. The kernel's work on a sandbox's mounts
  is charged to no process, so these rows count the whole machine's busy CPU
  (/proc/stat) while they run: run them on an idle machine;
* `scorer sandbox` — `/bin/true` in the sandbox a job scores that execution in, its argv
  built for each start as the evaluator builds it (`ScorerSandbox`: `scorer_allow_list`,
  no network), the building counted.
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


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(t) for t in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def sandboxes(repeat: int) -> dict[str, list[float]]:
    """Machine CPU seconds per start of an execution's bwrap sandbox, with the /etc snapshot
    and with /etc carved (each sample: the mean over 20 starts)."""
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from gyre.harness import sandbox
    from gyre.harness.workspace import prepare
    from gyre.tasks.suite import SHIPPED, load_suite

    if not sandbox.bwrap_available():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        task = load_suite(SHIPPED["learn"]).tasks[0]
        root = Path(tmp) / "workspaces"
        ex = prepare(root, "e0", task)
        mounts = sandbox.allow_list(ex, program="/bin/true", binds=[], hidden=task.hidden_paths,
                                    hide=[Path(tmp)], workspace_root=root)  # fmt: skip
        snapshot = [*sandbox.bwrap_argv(mounts, ex.workspace), "/bin/true"]
        # the same list with /etc's parts not marked as the system's: bwrap_argv binds them
        # one by one, as before the snapshot
        carved = [
            *sandbox.bwrap_argv([replace(m, system=False) for m in mounts], ex.workspace),
            "/bin/true",
        ]
        confine = sandbox.ScorerSandbox("bwrap", workspace_root=root, hide=(Path(tmp),))

        def scorer() -> list[str]:
            return confine(["/bin/true"], ex.workspace, task, [ex.workspace], {})[0]

        out: dict[str, list[float]] = {}
        for _ in range(repeat):
            for name, argv in (("bwrap sandbox", lambda: snapshot),
                               ("bwrap sandbox, /etc carved", lambda: carved),
                               ("scorer sandbox", scorer)):  # fmt: skip
                before = _busy_s()
                for _ in range(20):
                    subprocess.run(argv(), check=True)
                out.setdefault(name, []).append((_busy_s() - before) / 20)
    return out


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
    for name, cpu in sandboxes(args.repeat).items():
        rows[name] = {"mean_s": statistics.mean(cpu), "sd_s": statistics.pstdev(cpu), "n": len(cpu)}
        if not args.json:
            print(f"{name:26s} {rows[name]['mean_s'] * 1000:6.1f} ± {rows[name]['sd_s'] * 1000:.1f} "
                  f"ms of the machine's CPU (n={len(cpu)} x 20 starts)", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
