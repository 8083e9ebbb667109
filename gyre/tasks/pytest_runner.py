"""Run pytest in a workspace copy for the `tests` scoring rule, each test phase under a timer.

Standalone (pytest and the standard library only), so the evaluator can run it with
`python -I` in the scratch copy of a preserved workspace, the hidden tests copied in:

    python -I pytest_runner.py --junitxml /tmp/report.xml --per-test-timeout 10 \
        -- tests/test_parser.py tests/test_api.py

pytest is imported before the workspace joins `sys.path`, so a workspace file cannot stand
in for it; then the workspace comes first on `sys.path`, as under `python -m pytest`.
Each phase (setup, call, teardown) of a test runs under a SIGALRM timer: one that runs past
it fails with `TestPhaseTimeout`, and the run goes on. The outcome of every test is in the
JUnit XML report, which the evaluator reads (`gyre.tasks.scoring.tests`).

Exit status: pytest's own, or 97 (`NO_PYTEST`) when pytest cannot be imported.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

NO_PYTEST = 97


class TestPhaseTimeout(Exception):
    """A test's setup, call or teardown ran past the per-test limit."""

    __test__ = False  # not a test class, whatever pytest sees


def alarm(seconds: float) -> Iterator[None]:
    """A pluggy hook wrapper body: the wrapped hook runs under a `seconds` SIGALRM timer."""

    def expire(signum: int, frame: Any) -> None:
        raise TestPhaseTimeout(f"test phase ran past the per-test limit of {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timeout_plugin(pytest: Any, seconds: float) -> object:
    """A pytest plugin that runs each phase of each test under `alarm(seconds)`."""

    class PerTestTimeout:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_setup(self, item: Any) -> Iterator[None]:
            yield from alarm(seconds)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item: Any) -> Iterator[None]:
            yield from alarm(seconds)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_teardown(self, item: Any) -> Iterator[None]:
            yield from alarm(seconds)

    return PerTestTimeout()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junitxml", required=True)
    ap.add_argument("--per-test-timeout", type=float, required=True)
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    try:
        import pytest
    except ImportError as e:
        print(f"pytest cannot be imported by {sys.executable}: {e}", file=sys.stderr)
        return NO_PYTEST
    sys.path.insert(0, os.getcwd())
    options = [
        "-q", "-p", "no:cacheprovider", "--rootdir", os.getcwd(),
        "--continue-on-collection-errors", "--junitxml", args.junitxml,
    ]  # fmt: skip
    plugin = timeout_plugin(pytest, args.per_test_timeout)
    return int(pytest.main([*options, "--", *args.paths], plugins=[plugin]))


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no atexit hook or thread of the code under test rewrites the report after
