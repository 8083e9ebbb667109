"""One real `gyre run` per test session, shared by the export and stats tests.

`real_run(base)` runs `gyre run templates/local.yaml --steps 1` (the whole MPI job, about a
minute on 2 cores) into `base/real-run` the first time it is called for `base` and returns
that run directory; later calls (from another test module) reuse it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def real_run(base: Path) -> Path:
    run_dir = base / "real-run"
    cmd = [sys.executable, "-m", "gyre", "run", str(ROOT / "templates" / "local.yaml"),
           "--steps", "1", "--run-dir", str(run_dir), "--quiet"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=base)
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (run_dir / "trace.h5").exists()
    return run_dir
