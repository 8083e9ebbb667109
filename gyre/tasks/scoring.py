"""Scoring rules: turn a preserved workspace state into a score in [0, 1].

A rule is an async callable `score(state_dir, task) -> Score`; it always runs against a
scratch copy of a frozen snapshot, in a subprocess with a timeout, so nothing it does can
change the assessed state. `rules(confine)` wraps each of those subprocesses in `confine`
(a job's: its harness sandbox's `ScorerSandbox`), for the code it runs is the policy's. A
rule raises `EvaluatorError` when it cannot produce a score (crash, timeout, unreadable
output): that is an *unresolved* assessment, never a zero.
Failing tests are not an evaluator failure: they are a valid, low score.

Rules (name -> class in `RULES`):
* `hidden_tests`: runs the task's hidden test functions (`check_runner.py`) with the
  workspace on `sys.path`; score = passed / total (partial credit).
* `command`: runs an argv in the scratch copy; the last stdout line must be a number in
  [0, 1]; a non-zero exit or other output is an evaluator failure.
* `python`: calls `fn(workspace, data)` from the task's `function` file (`python_runner.py`);
  it returns a score in [0, 1] or `{"score", "detail", "critique"}`. An exception, another
  type or a value outside [0, 1] is an evaluator failure. A task with `transcript: true`
  gets `fn(workspace, data, transcript)`: the execution's transcript (data the evaluator
  was handed, `gyre.trajectory.transcript`); none handed is an evaluator failure.
* `tests`: copies the task's hidden tests into the scratch copy and runs pytest there
  (`pytest_runner.py`); score = the fraction of its FAIL_TO_PASS and PASS_TO_PASS node
  ids that pass (SWE-bench style partial credit), read from pytest's JUnit XML report.
  An id pytest did not report (a typo, a file that does not collect) fails, even when none
  is reported (the work broke every test: a valid zero); pytest's own crash (exit 3, 4, no
  report) is an evaluator failure. Each listed test's outcome travels with the score as a
  `TestVerdict` (`Score.tests`; empty for every other rule).
* `judge`: a model scores the work (and the transcript, `transcript: true`) against the
  task's hidden rubric; its answer is constrained to {score, critique} and parsed strictly;
  an unparsable answer, a timeout or an unreachable endpoint is an evaluator failure
  (`gyre.tasks.judge`; `agentic: true` runs a harness as the judge).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from gyre import fsafe
from gyre.lifetime import die_with_parent
from gyre.tasks.judge import Judge
from gyre.tasks.pytest_runner import NO_PYTEST
from gyre.tasks.scores import TEST_OUTCOMES as TEST_OUTCOMES
from gyre.tasks.scores import EvaluatorError as EvaluatorError
from gyre.tasks.scores import Score as Score
from gyre.tasks.scores import ScoringRule as ScoringRule
from gyre.tasks.scores import TestKind as TestKind
from gyre.tasks.scores import TestOutcome as TestOutcome
from gyre.tasks.scores import TestVerdict as TestVerdict
from gyre.tasks.scores import Transcript as Transcript
from gyre.tasks.suite import RULE_NAMES, Task

CHECK_RUNNER = Path(__file__).with_name("check_runner.py")
PYTHON_RUNNER = Path(__file__).with_name("python_runner.py")
PYTEST_RUNNER = Path(__file__).with_name("pytest_runner.py")


def scoring_env(home: Path) -> dict[str, str]:
    """A minimal environment for scoring subprocesses (no keys, no proxy URLs)."""
    return {
        "PATH": os.pathsep.join(
            [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
        ),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        # HOME is the scratch copy: its .local/lib/python*/site-packages is the work's own,
        # and a usercustomize.py there would run inside every `python3` the rule starts
        "PYTHONNOUSERSITE": "1",
    }


class Confine(Protocol):
    """Wraps a scoring process so that the code it runs sees only what it must
    (`gyre.harness.sandbox.ScorerSandbox`): (argv, cwd, task, writable folders, environment)
    -> (argv, environment) to start instead."""

    def __call__(
        self, argv: list[str], cwd: Path, task: Task, writable: Sequence[Path],
        env: dict[str, str],
    ) -> tuple[list[str], dict[str, str]]: ...  # fmt: skip


async def run_limited(
    argv: list[str], cwd: Path, timeout_s: float, task: Task, confine: Confine | None = None,
    writable: Sequence[Path] = (),
) -> tuple[int, str, str]:  # fmt: skip
    """Run argv in its own process group; kill the whole group on timeout or cancellation.
    `confine`: in the sandbox it makes, `cwd` and `writable` the only folders it may change.

    Output goes to temporary files, not pipes, so a killed scorer leaves nothing open.
    """
    name, env = argv[0], scoring_env(cwd)
    if confine is not None:
        argv, env = confine(argv, cwd, task, [cwd, *writable], env)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = await asyncio.create_subprocess_exec(
                *die_with_parent(argv), cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=err, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise EvaluatorError(f"cannot start scorer {name!r}: {e.strerror or e}") from None
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            raise EvaluatorError(f"scorer {name!r} timed out after {timeout_s:.1f}s") from None
        finally:  # also on cancellation: no scorer process outlives its attempt
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                await asyncio.shield(proc.wait())
        out.seek(0)
        err.seek(0)
        return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace")


async def run_runner(
    runner: Path, args: list[str], state_dir: Path, task: Task, what: str,
    inputs: dict[str, str] | None = None, confine: Confine | None = None,
) -> Any:  # fmt: skip
    """Run a standalone runner script (`python -I RUNNER ARGS --result FILE`) in the scratch
    copy under the task's timeout; the JSON it wrote, or an EvaluatorError if it wrote none.
    `inputs`: name -> text, each written to a file passed as `--NAME FILE`."""
    with tempfile.TemporaryDirectory(prefix="gyre-score-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, "-I", str(runner), *args, "--result", str(result)]
        for name, text in (inputs or {}).items():
            (Path(tmp) / f"{name}.json").write_text(text)
            argv += [f"--{name}", str(Path(tmp) / f"{name}.json")]
        rc, _out, err = await run_limited(
            argv, state_dir, task.scoring.timeout_s, task, confine, writable=[Path(tmp)]
        )
        try:
            return json.loads(result.read_text())
        except (OSError, ValueError):
            raise EvaluatorError(f"{what} exited {rc} without a result: {err[-500:]}") from None


async def hidden_tests(
    state_dir: Path, task: Task, transcript: Transcript | None = None,
    confine: Confine | None = None,
) -> Score:  # fmt: skip
    """Fraction of the task's hidden test functions that pass against state_dir."""
    from gyre.tasks.check_runner import count_tests, test_files

    tests = Path(task.scoring.tests)
    try:
        expected = {f"{f.stem}::{n}" for f in test_files(tests) for n in count_tests(f.read_text())}
    except (OSError, SyntaxError) as e:
        raise EvaluatorError(f"hidden tests {str(tests)!r} are unreadable: {e}") from None
    if not expected:
        raise EvaluatorError(f"hidden tests {str(tests)!r} define no test_* functions")
    args = ["--tests", str(tests), "--workspace", str(state_dir),
            "--per-test-timeout", str(task.scoring.per_test_timeout_s)]  # fmt: skip
    payload = await run_runner(CHECK_RUNNER, args, state_dir, task, "check runner", confine=confine)
    results = payload.get("results", {})
    if set(results) != expected:
        raise EvaluatorError("check runner result does not match the hidden tests")
    passed = sorted(k for k, v in results.items() if v == "pass")
    failed = {k: v for k, v in sorted(results.items()) if v != "pass"}
    critique = f"{len(passed)}/{len(expected)} hidden checks pass." + "".join(
        f"\n- {k}: {v}" for k, v in failed.items()
    )
    return Score(
        value=len(passed) / len(expected),
        detail={"passed": len(passed), "total": len(expected), "failed": sorted(failed)},
        critique=critique,
    )


async def command(
    state_dir: Path, task: Task, transcript: Transcript | None = None,
    confine: Confine | None = None,
) -> Score:  # fmt: skip
    """Score printed (last stdout line) by the task's scoring command."""
    cfg = task.scoring
    rc, out, err = await run_limited(list(cfg.command), state_dir, cfg.timeout_s, task, confine)
    if rc != 0:
        raise EvaluatorError(f"scoring command exited {rc}: {err.strip()[-500:]}")
    lines = out.strip().splitlines()
    try:
        value = float(lines[-1])
    except (IndexError, ValueError):
        raise EvaluatorError(
            f"scoring command printed no score on its last line: {out[-200:]!r}"
        ) from None
    if not 0.0 <= value <= 1.0:
        raise EvaluatorError(f"scoring command printed {value!r}; a score must lie in [0, 1]")
    return Score(value=value, detail={"stdout_tail": out[-500:]})


async def python(
    state_dir: Path, task: Task, transcript: Transcript | None = None,
    confine: Confine | None = None,
) -> Score:  # fmt: skip
    """Score returned by the task's reward function `fn(workspace, data)`, or
    `fn(workspace, data, transcript)` where the task asks for the transcript."""
    spec = task.scoring.function
    args = ["--function", spec, "--workspace", str(state_dir)]
    inputs = {"data": json.dumps(dict(task.data))}
    if task.scoring.transcript:
        if transcript is None:
            raise EvaluatorError("the task's rule reads the transcript; no transcript was passed")
        inputs["transcript"] = json.dumps(dict(transcript))
    payload = await run_runner(
        PYTHON_RUNNER, args, state_dir, task, "reward runner", inputs, confine
    )
    file, _, fn = spec.rpartition(":")
    name = f"{Path(file).name}:{fn}"
    if not isinstance(payload, dict) or "returned" not in payload:
        error = payload.get("error") if isinstance(payload, dict) else payload
        raise EvaluatorError(f"reward function {name} failed: {error}")
    return returned_score(payload["returned"], name)


def returned_score(returned: Any, name: str) -> Score:
    """The Score a reward function's return value stands for, or an EvaluatorError."""
    allowed = 'allowed: a number in [0, 1] or {"score": number, "detail": {...}, "critique": str}'
    if isinstance(returned, dict):
        unknown = sorted(set(returned) - {"score", "detail", "critique"})
        value, detail, critique = (returned.get(k) for k in ("score", "detail", "critique"))
        if unknown or not isinstance(detail or {}, dict) or not isinstance(critique or "", str):
            raise EvaluatorError(f"reward function {name} returned {returned!r:.300}; {allowed}")
    else:
        value, detail, critique = returned, {}, ""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise EvaluatorError(f"reward function {name} returned score {value!r:.100}; {allowed}")
    return Score(value=float(value), detail=dict(detail or {}), critique=critique or "")


async def tests(
    state_dir: Path, task: Task, transcript: Transcript | None = None,
    confine: Confine | None = None,
) -> Score:  # fmt: skip
    """Fraction of the task's FAIL_TO_PASS and PASS_TO_PASS pytest tests that pass."""
    cfg = task.scoring
    listed = [*cfg.fail_to_pass, *cfg.pass_to_pass]
    await asyncio.to_thread(reset_test_machinery, task.workspace, state_dir)
    await asyncio.to_thread(copy_hidden_tests, Path(cfg.tests), state_dir)
    files = sorted({n.partition("::")[0] for n in listed})
    present = [f for f in files if (state_dir / f).is_file()]
    if not present:  # the work deleted every listed test file: every listed test fails
        return tests_score(cfg.fail_to_pass, cfg.pass_to_pass, dict.fromkeys(listed))
    with tempfile.TemporaryDirectory(prefix="gyre-score-") as tmp:
        report = Path(tmp) / "junit.xml"
        argv = [
            sys.executable, "-I", str(PYTEST_RUNNER), "--junitxml", str(report),
            "--per-test-timeout", str(cfg.per_test_timeout_s), *present,
        ]  # fmt: skip
        rc, out, err = await run_limited(
            argv, state_dir, cfg.timeout_s, task, confine, writable=[Path(tmp)]
        )
        if rc == NO_PYTEST:
            raise EvaluatorError(err.strip()[-500:])
        outcomes = junit_outcomes(report, rc, out + err)
    # a listed test pytest did not report (its file no longer imports, say) fails: the work
    # is assessed, so breaking every test scores a valid zero, never an exclusion
    found = {n: outcomes.get(junit_key(n)) for n in listed}
    return tests_score(cfg.fail_to_pass, cfg.pass_to_pass, found)


TEST_MACHINERY = (
    "conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
)
"""Files through which a workspace configures pytest (hooks, plugins, addopts)."""


def reset_test_machinery(initial: Path, state_dir: Path) -> None:
    """Every conftest.py and pytest configuration file as the task's initial state has it
    (added ones removed): work that rewrites pytest's hooks to report passes scores as if it
    had not. Code the tests import is the work's own and is not reset."""
    names = set(TEST_MACHINERY)
    found = {
        f.relative_to(state_dir)
        for f in state_dir.rglob("*")
        if f.name in names and ".git" not in f.relative_to(state_dir).parts
    }
    originals = {
        f.relative_to(initial)
        for f in initial.rglob("*")
        if f.name in names and ".git" not in f.relative_to(initial).parts and f.is_file()
    }
    for rel in found | originals:
        clear_way(state_dir, rel)
        if rel in originals:
            (state_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(initial / rel, state_dir / rel)


def copy_hidden_tests(hidden: Path, state_dir: Path) -> None:
    """A hidden test file goes to the workspace's top; a directory's contents are laid over
    the workspace (`hidden/tests/test_x.py` -> `tests/test_x.py`, replacing that file).

    Whatever the workspace holds on a test's path is replaced, never followed: a symlink
    the harness left there (`tests -> /elsewhere`) must not carry the hidden tests out."""
    if hidden.is_dir():
        files = [(f, f.relative_to(hidden)) for f in sorted(hidden.rglob("*")) if f.is_file()]
    else:
        files = [(hidden, Path(hidden.name))]
    for src, rel in files:
        clear_way(state_dir, rel)
        (state_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, state_dir / rel)


def clear_way(root: Path, rel: Path) -> None:
    """Remove what stands on `root / rel` (anything) or on its parents (a symlink, a file)."""
    at = root
    for i, part in enumerate(rel.parts):
        at = at / part
        last = i == len(rel.parts) - 1
        if at.is_dir() and not at.is_symlink():
            if last:  # in the scratch copy a rule runs against (a gyre temporary directory)
                fsafe.remove_tree(at)
        elif at.is_symlink() or at.exists():
            at.unlink()


JUNIT_OUTCOMES = (("error", "error"), ("failure", "failed"), ("skipped", "skipped"))
"""A JUnit test case's child element -> its outcome, in order of precedence."""


def junit_outcomes(report: Path, rc: int, output: str) -> dict[tuple[str, str], str]:
    """(classname, name) -> passed | failed | error | skipped, from pytest's JUnit report.

    A test reported more than once (a failed call, then an error in teardown) keeps its
    first outcome that is not a pass.
    """
    if rc in (3, 4):  # pytest's internal error, usage error: the report cannot be trusted
        raise EvaluatorError(f"pytest failed (exit {rc}): {output.strip()[-500:]}")
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError) as e:
        raise EvaluatorError(
            f"pytest exited {rc} without a readable report ({e}): {output.strip()[-500:]}"
        ) from None
    outcomes: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        tags = {child.tag for child in case}
        outcome = next((o for t, o in JUNIT_OUTCOMES if t in tags), "passed")
        if outcomes.get(key, "passed") == "passed":
            outcomes[key] = outcome
    return outcomes


def junit_key(node_id: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit report gives the test `node_id`:
    `tests/test_a.py::TestB::test_c[x/y]` -> ("tests.test_a.TestB", "test_c[x/y]")."""
    address, bracket, params = node_id.partition("[")
    names = address.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def tests_score(
    fail_to_pass: list[str], pass_to_pass: list[str], found: dict[str, str | None]
) -> Score:
    """Partial credit: passed / listed, with per-list counts, the failing ids and every
    listed test's `TestVerdict` (FAIL_TO_PASS first, each list in its order)."""
    failed = {n: o or "not reported" for n, o in found.items() if o != "passed"}
    lists: tuple[tuple[TestKind, list[str]], ...] = (
        ("fail_to_pass", fail_to_pass), ("pass_to_pass", pass_to_pass),
    )  # fmt: skip
    verdicts = tuple(
        TestVerdict(test=n, kind=kind, outcome=outcome_of(found.get(n)))
        for kind, ids in lists
        for n in ids
    )
    counts = {
        key: {"passed": sum(n not in failed for n in ids), "total": len(ids)}
        for key, ids in (("fail_to_pass", fail_to_pass), ("pass_to_pass", pass_to_pass))
    }
    passed, total = len(found) - len(failed), len(found)
    f2p, p2p = counts["fail_to_pass"], counts["pass_to_pass"]
    critique = (
        f"{passed}/{total} tests pass (FAIL_TO_PASS {f2p['passed']}/{f2p['total']}, "
        f"PASS_TO_PASS {p2p['passed']}/{p2p['total']})."
        + "".join(f"\n- {n}: {o}" for n, o in sorted(failed.items()))
    )
    return Score(
        value=passed / total, detail={**counts, "failed": sorted(failed)}, critique=critique,
        tests=verdicts,
    )  # fmt: skip


def outcome_of(junit: str | None) -> TestOutcome:
    """A JUnit outcome (`junit_outcomes`) as a `TestVerdict` outcome; None: not reported."""
    for outcome in TEST_OUTCOMES:
        if junit == outcome:
            return outcome
    return "not_reported"


def rules(confine: Confine | None = None) -> dict[str, ScoringRule]:
    """Every rule by name, each scoring process wrapped by `confine` (a job passes its
    harness sandbox's `ScorerSandbox`); `judge` asks a task's own judge.endpoint (a job puts
    `Judge(its engines)` in its place)."""
    return {
        "hidden_tests": partial(hidden_tests, confine=confine),
        "command": partial(command, confine=confine),
        "python": partial(python, confine=confine),
        "tests": partial(tests, confine=confine),
        "judge": Judge(),
    }


RULES = rules()
"""The rules with unconfined scoring processes (a library user's `Evaluator()`)."""
assert tuple(RULES) == RULE_NAMES, "every rule a task may name has exactly one implementation"
