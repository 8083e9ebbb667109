"""The shipped repository task (`gyre/tasks/examples/repository/median`) and the per-test
verdicts of repository tasks: the evaluator's `Verdict.tests` -> the runtime's
`VerdictRecord.tests` (`ExecutionHost`) -> the trace's close meta -> the export's `tests`
column -> `gyre eval`'s results (eval.json). Real git, real pytest, real HDF5 and Parquet;
the last test runs `gyre eval` with a scripted harness that applies a fix or a wrong fix."""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import yaml

from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.evaluation import EvalResult, _merge, load_results
from gyre.runtime.proxy_node.node import ExecutionHost
from gyre.runtime.shared.config import load_run_config
from gyre.runtime.shared.messages import VerdictRecord
from gyre.tasks import Evaluator, Task, load_suite
from gyre.tasks.scoring import TestOutcome, TestVerdict
from gyre.trajectory.export import export_trace
from gyre.trajectory.reader import TraceReader
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import VerdictStatus

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "gyre" / "tasks" / "examples" / "repository"
SOURCE = SUITE / "median" / "stats.git"
F2P = "tests/test_summary.py::test_median_of_an_even_count"
P2P = ["tests/test_summary.py::test_mean", "tests/test_summary.py::test_median_of_an_odd_count"]
# stats/summary.py's median(), as a fix or wrong fixes would leave it
BUGGY_LINE = "    return ordered[len(ordered) // 2]\n"
LOWER_MIDDLE = "    return ordered[(len(ordered) - 1) // 2]\n"  # still wrong for an even count
ALWAYS_MEAN = "    m = len(ordered) // 2\n    return (ordered[m - 1] + ordered[m]) / 2\n"


def verdicts(
    f2p: TestOutcome, mean: TestOutcome = "passed", odd: TestOutcome = "passed"
) -> tuple[TestVerdict, ...]:
    """The expected per-test verdicts: FAIL_TO_PASS first, then PASS_TO_PASS, as listed."""
    return (
        TestVerdict(test=F2P, kind="fail_to_pass", outcome=f2p),
        TestVerdict(test=P2P[0], kind="pass_to_pass", outcome=mean),
        TestVerdict(test=P2P[1], kind="pass_to_pass", outcome=odd),
    )


UNCHANGED, FIXED, LOWER = verdicts("failed"), verdicts("passed"), verdicts("failed")
BROKEN = verdicts("passed", odd="failed")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> None:
    """The example's checkout goes to a cache of this test's own (inherited by `gyre eval`)."""
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def task() -> Task:
    return load_suite(SUITE)["median"]


def summary(kind: str) -> str:
    """stats/summary.py as `kind` leaves it: the repository's own fix (its later commit on
    main, which the workspace does not hold), a wrong fix, or unchanged."""
    if kind == "fix":
        argv = ["git", "--git-dir", str(SOURCE), "show", "main:stats/summary.py"]
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    buggy = subprocess.run(
        ["git", "--git-dir", str(SOURCE), "show", "bug:stats/summary.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert BUGGY_LINE in buggy
    wrong = {"lower": LOWER_MIDDLE, "mean": ALWAYS_MEAN}
    return buggy.replace(BUGGY_LINE, wrong[kind]) if kind in wrong else buggy


def workspace(task: Task, root: Path, eid: str, kind: str) -> Path:
    """An execution's preserved workspace: the initial checkout, summary.py as `kind`."""
    ws = root / eid / "workspace"
    shutil.copytree(task.workspace, ws, symlinks=True)
    (ws / "stats" / "summary.py").write_text(summary(kind))
    return ws


def test_the_example_ships_as_package_data() -> None:
    """Every file of the example (the bare repository's objects and refs included) matches
    a package-data pattern of pyproject.toml (globbed as setuptools globs them), so an
    installed Gyre has the whole task."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = ROOT / "gyre"
    shipped = {f for p in setuptools["package-data"]["gyre"] for f in package.glob(p)}
    files = {f for f in SUITE.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert {SOURCE / "HEAD", SOURCE / "refs" / "tags" / "bug"} <= files
    assert sorted(files - shipped) == []


def test_the_example_starts_at_the_bug_and_hides_its_fix(task: Task) -> None:
    assert task.scoring.rule == "tests"
    assert (task.scoring.fail_to_pass, task.scoring.pass_to_pass) == ([F2P], P2P)
    log = subprocess.run(["git", "log", "--all", "--format=%s"], cwd=task.workspace,
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    assert log.splitlines() == ["stats: mean and median"]  # the fix commit is not there
    shipped_tests = (task.workspace / "tests" / "test_summary.py").read_text()
    assert "test_median_of_an_even_count" not in shipped_tests  # it is hidden
    assert {SOURCE, SUITE / "median" / "hidden"} <= set(task.hidden_paths)


@pytest.mark.parametrize(
    ("kind", "reward", "expected"),
    [("unchanged", 2 / 3, UNCHANGED), ("fix", 1.0, FIXED), ("lower", 2 / 3, LOWER),
     ("mean", 2 / 3, BROKEN)],
)  # fmt: skip
def test_the_evaluator_keeps_each_tests_verdict(
    task: Task, tmp_path: Path, make_terminated, kind: str, reward: float, expected: tuple
) -> None:
    ws = workspace(task, tmp_path / "runs", "e0", kind)
    evaluator = Evaluator(Evaluator.Config(max_attempts=1))
    verdict = asyncio.run(evaluator.assess(make_terminated(ws), task))
    assert verdict.status is VerdictStatus.SCORED, verdict.assessment.error
    assert verdict.reward == pytest.approx(reward)
    assert verdict.tests == expected == verdict.assessment.tests


def test_verdicts_without_a_valid_score_carry_no_tests(task: Task, make_terminated) -> None:
    placeholder = asyncio.run(Evaluator().assess(make_terminated(None, assessable=False), task))
    assert placeholder.status is VerdictStatus.PLACEHOLDER and placeholder.tests == ()


def host(tmp_path: Path) -> ExecutionHost:
    """The run's execution host (not started: no engine, no proxy) on the example suite."""
    cfg = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    cfg["harness"].update({"suite": str(SUITE), "tasks": ["median"]})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ExecutionHost(load_run_config(path), tmp_path / "run")


def test_per_test_verdicts_reach_the_trace_and_its_export(task: Task, tmp_path: Path) -> None:
    """`ExecutionHost.rescore` (the runtime's verdict of a preserved workspace) -> the
    coordinator's `RunRecorder` -> trace.h5 -> `gyre trace export`."""
    h = host(tmp_path)
    records: dict[str, VerdictRecord] = {}
    for eid, kind in (("fix", "fix"), ("wrong", "lower")):
        workspace(task, tmp_path / "run" / "workspaces", eid, kind)
        records[eid] = asyncio.run(h.rescore(eid, task))
    assert records["fix"].tests == FIXED and records["wrong"].tests == LOWER
    assert pickle.loads(pickle.dumps(records["fix"])) == records["fix"]  # as `wire` sends it
    # a task of another rule (or a trace written before per-test verdicts): none
    records["other"] = VerdictRecord(status=VerdictStatus.SCORED, reward=0.5, t=1.0)
    (tmp_path / "out").mkdir()
    rec = RunRecorder(tmp_path / "out" / "trace.h5", {"config": ""}, cells=1)
    for eid, verdict in records.items():
        rec.open_execution(eid, {"task": "median" if eid != "other" else "add"})
        rec.close_execution(eid, "g0", TrajectoryTree(eid), "completed", verdict)
    rec.close()
    with TraceReader(tmp_path / "out" / "trace.h5") as reader:
        meta = {i.execution_id: i.meta for i in reader.executions()}
    assert [TestVerdict.from_dict(d) for d in meta["fix"]["tests"]] == list(FIXED)
    assert [TestVerdict.from_dict(d) for d in meta["wrong"]["tests"]] == list(LOWER)
    assert "tests" not in meta["other"]
    files = export_trace(tmp_path / "out", tmp_path / "export")
    rows = pd.read_parquet(files["executions"]).set_index("execution_id")["tests"]
    exported = {eid: [TestVerdict.from_dict(d) for d in json.loads(rows[eid])] for eid in records}
    assert exported == {"fix": list(FIXED), "wrong": list(LOWER), "other": []}


def test_eval_json_keeps_each_executions_tests(tmp_path: Path) -> None:
    result = EvalResult("final", 3, "m", {"a": 1.0, "b": 0.5}, tests={"a": FIXED})
    _merge(tmp_path / "eval.json", [result], ["median"], 2)
    (saved,) = load_results(tmp_path)
    assert saved["tests"] == {"a": [t.to_dict() for t in FIXED], "b": []}
    assert saved["tests"]["a"][0] == {"test": F2P, "kind": "fail_to_pass", "outcome": "passed"}


# the scripted harness: execution 0 applies the repository's fix, execution 1 a wrong one
HARNESS = """\
import os, pathlib, sys
fix, wrong = sys.argv[1:3]
k = int(os.environ["GYRE_EXECUTION_ID"].rsplit("-", 1)[1])
pathlib.Path("stats/summary.py").write_text([fix, wrong][k])
"""


@pytest.mark.slow
def test_gyre_eval_reports_each_tests_verdict(tmp_path: Path) -> None:
    """`gyre eval` of the example with a scripted harness: the per-test verdicts of a fix and
    a wrong fix in its results (what eval.json holds for a run directory)."""
    cfg = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    command = [sys.executable, "-c", HARNESS, summary("fix"), summary("lower")]
    cfg["harness"].update({
        "suite": str(SUITE), "tasks": ["median"], "sandbox": "none", "adapter": "scripted",
        "params": {}, "adapters": {"scripted": {"api": "openai", "command": command}},
    })  # fmt: skip
    cfg["eval"] = {"suite": str(SUITE)}  # the task has one instance: score it as held out
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "gyre", "eval", "tiny", "--config", str(path), "--instances", "2",
         "--out", str(tmp_path / "eval"), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert result["rewards"] == {"eval-median-0": 1.0, "eval-median-1": pytest.approx(2 / 3)}
    tests = {x: [TestVerdict.from_dict(d) for d in ts] for x, ts in result["tests"].items()}
    assert tests == {"eval-median-0": list(FIXED), "eval-median-1": list(LOWER)}
