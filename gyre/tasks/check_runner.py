"""Run hidden test functions against a workspace copy and write a JSON result file.

Standalone (standard library only) so the evaluator can run it with `python -I` in a
scratch copy of the preserved workspace, outside the harness's reach:

    python -I check_runner.py --tests hidden/ --workspace /tmp/scratch \
        --result /tmp/result.json --per-test-timeout 10

Each top-level `def test_*()` in each `test_*.py` is one check; partial credit is the
fraction that pass. Tests are counted from the source (AST) before anything runs, so a
workspace whose code fails to import scores 0 of N (a valid zero), and code under test
cannot inflate the count. Each test runs under a SIGALRM timer. The process ends as soon
as the result is written (`leave`): code under test that left an atexit hook or a thread
behind to rewrite it never gets to run.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path


def test_files(tests: Path) -> list[Path]:
    """The hidden test files: `tests` itself or its test_*.py files, sorted."""
    if tests.is_dir():
        return sorted(tests.glob("test_*.py"))
    return [tests]


def count_tests(source: str) -> list[str]:
    """Names of the top-level test functions in a test module's source."""
    tree = ast.parse(source)
    return [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    ]


class _TestTimeout(Exception):
    pass


def _on_alarm(signum, frame):  # type: ignore[no-untyped-def]
    raise _TestTimeout("test timed out")


def _run_one(fn, timeout_s: float) -> str:  # type: ignore[no-untyped-def]
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        fn()
        return "pass"
    except BaseException as e:  # any failure of code under test is a fail
        return f"fail: {type(e).__name__}: {str(e)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_file(path: Path, timeout_s: float) -> dict[str, str]:
    names = count_tests(path.read_text())
    results = dict.fromkeys(names, "fail: not run")
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        module = runpy.run_path(str(path), run_name=f"gyre_hidden_{path.stem}")
    except BaseException as e:  # import failure of the code under test
        reason = f"fail: import error: {type(e).__name__}: {str(e)[:200]}"
        return dict.fromkeys(names, reason)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    for name in names:
        fn = module.get(name)
        if callable(fn):
            results[name] = _run_one(fn, timeout_s)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", required=True, type=Path)
    ap.add_argument("--workspace", required=True, type=Path)
    ap.add_argument("--result", required=True, type=Path)
    ap.add_argument("--per-test-timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    files = test_files(args.tests.resolve())
    result_path = args.result.resolve()
    workspace = args.workspace.resolve()
    os.chdir(workspace)
    sys.path.insert(0, str(workspace))
    signal.signal(signal.SIGALRM, _on_alarm)
    results: dict[str, str] = {}
    for f in files:
        for name, outcome in run_file(f, args.per_test_timeout).items():
            results[f"{f.stem}::{name}"] = outcome
    payload = {
        "total": len(results),
        "passed": sum(v == "pass" for v in results.values()),
        "results": results,
    }
    result_path.write_text(json.dumps(payload))
    return 0


def leave(rc: int) -> None:
    """Exit at once with `rc`: no atexit hook or thread of the code under test runs after
    the result is written (one that rewrote it would forge the verdict)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    try:
        leave(main())
    except Exception:
        traceback.print_exc()
        leave(3)
