"""Bad input on the command line: one line naming what was wrong and what is allowed, exit 2,
no traceback, and nothing started. The corpus of such inputs is tests/test_bad_input_corpus.py
(in-process); here, what needs a real process (a closed pipe), and the `gyre` / one-line
helpers other tests use.

Each case is a real `gyre` process, as a user types it. None of them may start an MPI world,
an engine or a Slurm job: the checks run before anything does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gyre.trajectory.store import TraceWriter

ROOT = Path(__file__).resolve().parents[1]


def gyre(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gyre", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)  # fmt: skip


def one_line_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("gyre "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and all(n in lines[0] for n in needles), lines[0]


def test_trace_show_takes_a_run_directory_and_a_closed_pipe(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with TraceWriter(run / "trace.h5", run_meta={"config": "x: 1"}):
        pass
    shown = gyre("trace", "show", str(run), "--json")
    assert shown.returncode == 0 and '"writer_closed": true' in shown.stdout, shown.stderr
    # `gyre trace show ... | head -1`: the reader is gone before the output is written
    for action in ("show", "stats"):
        proc = subprocess.Popen([sys.executable, "-m", "gyre", "trace", action, str(run), "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141 and err == "", (action, err)


@pytest.mark.parametrize("bad", ["-x=1", "train.lr"])
def test_what_is_not_an_override_stays_unrecognized(bad: str) -> None:
    out = gyre("run", "templates/local.yaml", "--steps", "2", bad)
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr, out.stderr
