"""One real `gyre run` shared by every test that only reads a finished run (tests only).

`e2e_world(base)` runs the end-to-end job once — the small config of tests/runtime (2 steps,
three cells), a suite with a learnable task, a slow one and one whose evaluator always
crashes, every experiment tracker on, and cell 2's engine SIGKILLed while harnesses are live —
and returns what a test reads from it. The `e2e_run` fixture (tests/conftest.py) hands it to
the end-to-end assertions, the trace export and the trace stats tests; tests that use it are
put on one pytest-xdist worker, so the world runs once per test session.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from processes import scan
from runtime.conftest import crashing_suite, small_config, write_config

ROOT = Path(__file__).resolve().parents[1]
KILLED_ENGINE = 2
TRACKERS = {"tensorboard": {"enabled": True}, "wandb": {"enabled": True},
            "mlflow": {"enabled": True}}  # fmt: skip


@dataclass(frozen=True)
class World:
    run_dir: Path
    returncode: int
    output: str  # `gyre run`'s stdout and stderr
    engine_killed: bool  # cell 2's engine was SIGKILLed while harnesses ran
    kill_t: float  # unix time of the kill
    live_on_killed: tuple[str, ...]  # open executions whose last call that engine served


def _live_on(run_dir: Path, engine_id: str) -> list[str]:
    """Open executions of the live trace whose newest recorded call `engine_id` served."""
    from gyre.errors import StoreError
    from gyre.trajectory.reader import TraceReader

    try:
        with TraceReader(run_dir / "trace.h5") as r:
            open_ = {i.execution_id for i in r.executions() if not i.closed}
            return [eid for eid, tree in r.recover().items()
                    if eid in open_ and tree.nodes and tree.nodes[-1].engine_id == engine_id]  # fmt: skip
    except (StoreError, OSError):  # not there yet, or the writer holds it a moment
        return []


def _kill_engine_when_busy(
    proc: subprocess.Popen, run_dir: Path, index: int
) -> tuple[bool, float, list[str]]:
    """SIGKILL engine `index` once it serves live executions (seen in the live trace); returns
    (killed, when, those executions); (False, 0, []) if the run ended first."""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        live = _live_on(run_dir, f"e{index}") if (run_dir / "trace.h5").exists() else []
        engines = [p.pid for p in scan(run_dir) if p.kind == "engine" and p.index == index]
        pid = engines[0] if len(live) >= 2 and engines else None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            return True, time.time(), live
        time.sleep(0.3)
    return False, 0.0, []


@functools.cache
def e2e_world(base: Path) -> World:
    cfg = small_config(base, steps=2)
    cfg["harness"]["suite"] = str(crashing_suite(base))
    # groups draw tasks round robin: the learnable notes often, so a batch's rewards differ
    cfg["harness"]["tasks"] = ["notes", "add", "crashy", "notes", "fizzbuzz"]
    cfg["harness"]["params"].update({"max_turns": "3", "max_tokens": "96", "delegate": "off"})
    cfg["schedule"]["batch_groups"] = 3
    # the crashy evaluator gives up after 2 attempts (not at the overall budget), so its
    # groups are ready, and set aside, within the 2 steps
    cfg["harness"]["eval_attempts"] = 2
    cfg["tracking"] = TRACKERS
    path = write_config(base, cfg)
    run_dir = base / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre", "run", str(path), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=base,
    )  # fmt: skip
    try:
        killed, kill_t, live = _kill_engine_when_busy(proc, run_dir, KILLED_ENGINE)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return World(run_dir, proc.returncode, out, killed, kill_t, tuple(live))
