"""Repository tasks (a git repository at a commit, setup commands, a content-addressed
checkout cache) and the `tests` scoring rule (FAIL_TO_PASS / PASS_TO_PASS partial credit),
against a real git repository built in tmp_path and real pytest subprocesses."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gyre.errors import ConfigError
from gyre.tasks import Evaluator, EvaluatorError, load_suite, scoring
from gyre.tasks.repository import RepositoryConfig
from gyre.tasks.scoring import junit_key, junit_outcomes
from gyre.tasks.suite import ScoringConfig, TaskConfig
from gyre.vocabulary import VerdictStatus

BUGGY = """\
def area(w, h):
    return w + h


def perimeter(w, h):
    return w + h


def scale(x, k):
    return x * k
"""
FIXED_AREA = BUGGY.replace("return w + h\n\n\ndef perimeter", "return w * h\n\n\ndef perimeter")
FIXED = FIXED_AREA.replace("return w + h\n\n\ndef scale", "return 2 * (w + h)\n\n\ndef scale")
HIDDEN_TESTS = """\
from shapes.geometry import area, perimeter, scale


def test_area():
    assert area(2, 3) == 6


def test_perimeter():
    assert perimeter(2, 3) == 10


def test_scale():
    assert scale(2, 3) == 6
"""
F2P = ["tests/test_geometry.py::test_area", "tests/test_geometry.py::test_perimeter"]
P2P = ["tests/test_geometry.py::test_scale"]


def git(cwd: Path, *args: str) -> str:
    argv = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True).stdout


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Checkouts go to a cache of this test's own."""
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "repos"


@pytest.fixture
def source(tmp_path) -> dict[str, str]:
    """A repository with the buggy package at commit `bug` and its fix at `fix` (on main);
    hidden tests (2 FAIL_TO_PASS, 1 PASS_TO_PASS) in a directory beside it."""
    repo = tmp_path / "repo"
    (repo / "shapes").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "shapes" / "__init__.py").write_text("")
    (repo / "shapes" / "geometry.py").write_text(BUGGY)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_existing.py").write_text("def test_existing():\n    pass\n")
    bug = commit_all(repo, "shapes with two bugs")
    (repo / "shapes" / "geometry.py").write_text(FIXED)
    fix = commit_all(repo, "fix area and perimeter")
    (tmp_path / "hidden" / "tests").mkdir(parents=True)
    (tmp_path / "hidden" / "tests" / "test_geometry.py").write_text(HIDDEN_TESTS)
    return {"bug": bug, "fix": fix}


def write_suite(tmp_path: Path, commit: str, *, setup=(), **scoring) -> Path:
    task = {
        "name": "shapes",
        "instruction": "Fix area and perimeter in shapes/geometry.py.",
        "repository": {"path": "repo", "commit": commit, "setup": [list(a) for a in setup]},
        "scoring": {
            "rule": "tests", "tests": "hidden", "fail_to_pass": F2P, "pass_to_pass": P2P,
            "timeout_s": 60, **scoring,
        },
    }  # fmt: skip
    path = tmp_path / "suite.yaml"
    path.write_text(json.dumps({"name": "repos", "tasks": [task]}))
    return path


def execution(task, tmp_path: Path, name: str, geometry: str | None = None) -> Path:
    """An execution's preserved workspace: the task's initial state, geometry.py replaced."""
    ws = tmp_path / "runs" / name / "workspace"
    shutil.copytree(task.workspace, ws, symlinks=True)
    if geometry is not None:
        (ws / "shapes" / "geometry.py").write_text(geometry)
    return ws


def assess(task, ws: Path, make_terminated):
    evaluator = Evaluator(Evaluator.Config(max_attempts=1))
    return asyncio.run(evaluator.assess(make_terminated(ws), task))


def test_partial_credit_is_the_fraction_of_listed_tests_passing(tmp_path, source, make_terminated):
    task = load_suite(write_suite(tmp_path, source["bug"]))["shapes"]
    expected = [
        (None, 1 / 3, 0, 1, F2P),  # unchanged: only the PASS_TO_PASS test passes
        (FIXED_AREA, 2 / 3, 1, 1, F2P[1:]),
        (FIXED, 1.0, 2, 1, []),
        (FIXED.replace("x * k", "x + k"), 2 / 3, 2, 0, P2P),  # the fix broke a passing test
    ]
    for i, (geometry, value, f2p, p2p, failed) in enumerate(expected):
        verdict = assess(task, execution(task, tmp_path, f"e{i}", geometry), make_terminated)
        assert verdict.status is VerdictStatus.SCORED, verdict.assessment.error
        assert verdict.reward == pytest.approx(value), i
        detail = verdict.assessment.detail
        assert detail["fail_to_pass"] == {"passed": f2p, "total": 2}
        assert detail["pass_to_pass"] == {"passed": p2p, "total": 1}
        assert detail["failed"] == sorted(failed)
        assert all(f"- {n}: failed" in verdict.assessment.critique for n in failed)


def test_the_workspace_is_the_commit_without_later_history(tmp_path, source):
    task = load_suite(write_suite(tmp_path, "main~1"))["shapes"]  # a ref names the commit
    ws = task.workspace
    assert (ws / "shapes" / "geometry.py").read_text() == BUGGY
    assert git(ws, "rev-parse", "HEAD").strip() == source["bug"]
    assert git(ws, "log", "--all", "--format=%H").split() == [source["bug"]]
    missing = subprocess.run(["git", "cat-file", "-e", source["fix"]], cwd=ws)
    assert missing.returncode != 0  # the fix commit's objects are gone, not only its refs
    assert git(ws, "remote").strip() == "" and git(ws, "reflog").strip() == ""
    (ws / ".gyre_home").mkdir()  # the harness's HOME is no change of the repository
    (ws / ".gyre_home" / "x").write_text("")
    assert git(ws, "status", "--porcelain").strip() == ""
    assert task.workspace.is_relative_to(tmp_path / "cache" / "repos")


def test_the_hidden_tests_and_the_source_repository_are_hidden(tmp_path, source):
    task = load_suite(write_suite(tmp_path, source["bug"]))["shapes"]
    assert (tmp_path / "hidden").resolve() in task.hidden_paths
    assert (tmp_path / "repo").resolve() in task.hidden_paths  # it holds the fix commit
    assert not (task.workspace / "tests" / "test_geometry.py").exists()


def test_setup_runs_once_and_a_second_load_reuses_the_checkout(tmp_path, source, cache):
    runs = tmp_path / "setup-runs"
    record = f"open({str(runs)!r}, 'a').write('x'); open('built.txt', 'w').write('ok')"
    suite = write_suite(tmp_path, source["bug"], setup=[[sys.executable, "-c", record]])
    first = load_suite(suite)["shapes"].workspace
    mtime = (first / "built.txt").stat().st_mtime_ns
    second = load_suite(suite)["shapes"].workspace
    assert second == first and runs.read_text() == "x"  # no second clone, no second setup
    assert (second / "built.txt").stat().st_mtime_ns == mtime
    assert [p.name for p in cache.iterdir()] == [first.name]  # no temporary directory left
    other = load_suite(write_suite(tmp_path, source["fix"]))["shapes"].workspace
    assert other != first  # another commit is another entry


def test_a_failed_build_is_never_reused(tmp_path, source, cache):
    runs = tmp_path / "setup-runs"
    flaky = (
        f"import pathlib, sys; p = pathlib.Path({str(runs)!r}); p.write_text(p.read_text() + 'x'"
        " if p.exists() else 'x'); print('setup broke'); sys.exit(3 if p.read_text() == 'x' else 0)"
    )
    suite = write_suite(tmp_path, source["bug"], setup=[["true"], [sys.executable, "-c", flaky]])
    with pytest.raises(ConfigError) as e:
        load_suite(suite)
    message = str(e.value)
    assert "suite.yaml.tasks[0].repository.setup[1]: task 'shapes'" in message
    assert "exited 3" in message and "setup broke" in message and flaky in message
    assert list(cache.iterdir()) == []  # nothing half-built under any name
    task = load_suite(suite)["shapes"]
    assert runs.read_text() == "xx" and (task.workspace / "shapes").is_dir()


def test_a_setup_command_past_its_limit_is_a_config_error(tmp_path, source):
    suite = write_suite(tmp_path, source["bug"], setup=[["sleep", "30"]])
    text = json.loads(suite.read_text())
    text["tasks"][0]["repository"]["timeout_s"] = 0.5
    suite.write_text(json.dumps(text))
    with pytest.raises(ConfigError, match=r"setup\[0\]: task 'shapes'.*ran past 0.5s"):
        load_suite(suite)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"commit": "0" * 40}, r"repository.commit: '0{40}' is not a commit of"),
        ({"commit": "no-such-branch"}, "'no-such-branch' is not a commit"),
        ({"path": "nowhere"}, r"repository.path: .*nowhere' does not exist"),
        ({"path": "repo/shapes"}, "is not the top directory of a git repository"),
        ({"path": "hidden"}, "is not the top directory of a git repository"),
        ({"setup": [[]]}, r"repository.setup\[0\]: \[\]; allowed: a non-empty argv"),
    ],
)
def test_a_bad_repository_entry_is_a_config_error(tmp_path, source, change, match):
    suite = write_suite(tmp_path, source["bug"])
    text = json.loads(suite.read_text())
    text["tasks"][0]["repository"].update(change)
    suite.write_text(json.dumps(text))
    with pytest.raises(ConfigError, match=match):
        load_suite(suite)


def test_workspace_and_repository_exclude_each_other():
    repository = RepositoryConfig(path="repo", commit="main")
    scoring = ScoringConfig(rule="command", command=["true"])
    with pytest.raises(ConfigError, match="workspace: 'ws' and repository: are both set"):
        TaskConfig(instruction="x", workspace="ws", repository=repository, scoring=scoring)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"tests": "h", "pass_to_pass": P2P}, "fail_to_pass: required for rule 'tests'"),
        ({"fail_to_pass": F2P}, "tests: required for rule 'tests'"),
        ({"tests": "h", "fail_to_pass": ["tests/test_a.py"]}, r"fail_to_pass\[0\].*node id"),
        ({"tests": "h", "fail_to_pass": ["../t.py::test_a"]}, "relative to the workspace"),
        ({"tests": "h", "fail_to_pass": F2P, "pass_to_pass": F2P[:1]}, "listed twice"),
    ],
)
def test_a_bad_tests_rule_is_a_config_error(keys, match):
    with pytest.raises(ConfigError, match=match):
        ScoringConfig(rule="tests", **keys)


def test_node_ids_belong_to_the_tests_rule_only():
    with pytest.raises(ConfigError, match="fail_to_pass: only for rule 'tests', not 'command'"):
        ScoringConfig(rule="command", command=["true"], fail_to_pass=F2P)


def test_unreported_tests_fail_and_a_hanging_one_times_out(tmp_path, source):
    """A typo, a missing file and a file that does not collect fail their tests; the
    other files still run, and a hanging test fails alone, within its limit."""
    (tmp_path / "hidden" / "tests" / "test_broken.py").write_text("import no_such_module\n")
    unreported = [
        "tests/test_geometry.py::test_areaa",
        "tests/test_gone.py::test_a",
        "tests/test_broken.py::test_a",
    ]
    suite = write_suite(
        tmp_path, source["bug"], fail_to_pass=[*F2P, *unreported],
        pass_to_pass=[*P2P, "tests/test_existing.py::test_existing"], per_test_timeout_s=0.5,
    )  # fmt: skip
    task = load_suite(suite)["shapes"]
    hangs = FIXED.replace("return 2 * (w + h)", "while True:\n        pass")
    score = asyncio.run(scoring.tests(execution(task, tmp_path, "e0", hangs), task))
    assert score.value == pytest.approx(3 / 7)
    assert score.detail["failed"] == sorted([F2P[1], *unreported])
    assert score.detail["pass_to_pass"] == {"passed": 2, "total": 2}
    assert all(f"- {n}: not reported" in score.critique for n in unreported)
    assert f"- {F2P[1]}: failed" in score.critique


def test_hidden_tests_replace_what_the_harness_left_on_their_path(
    tmp_path, source, make_terminated
):
    """A symlink on a hidden test's path is replaced, not followed: the hidden tests are
    not written outside the scratch copy, and the harness's stand-in tests do not count."""
    task = load_suite(write_suite(tmp_path, source["bug"]))["shapes"]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_geometry.py").write_text("def test_area():\n    pass\n")
    ws = execution(task, tmp_path, "e0")
    shutil.rmtree(ws / "tests")
    (ws / "tests").symlink_to(outside)
    verdict = assess(task, ws, make_terminated)
    assert verdict.reward == pytest.approx(1 / 3)
    assert [p.name for p in outside.iterdir()] == ["test_geometry.py"]
    assert (outside / "test_geometry.py").read_text() == "def test_area():\n    pass\n"


def test_work_that_breaks_every_listed_test_scores_zero_not_unresolved(
    tmp_path, source, make_terminated
):
    """An unresolved verdict excludes the execution from training: breaking the package
    (nothing collects) or deleting the test files must be a valid zero, or it is a way out."""
    task = load_suite(write_suite(tmp_path, source["bug"]))["shapes"]
    ws = execution(task, tmp_path, "e0", "def area(w, h) return w * h\n")  # nothing collects
    score = asyncio.run(scoring.tests(ws, task))
    assert score.value == 0.0 and len(score.detail["failed"]) == 3
    verdict = assess(
        task, execution(task, tmp_path, "e1", "def area(w, h) return w * h\n"), make_terminated
    )
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 0.0


def test_repository_rows_of_a_data_suite(tmp_path, source, make_terminated):
    row = {
        "id": "shapes-1",
        "instruction": "Fix shapes.",
        "repository": {"path": "repo", "commit": source["bug"]},
        "scoring": {"rule": "tests", "tests": "hidden", "fail_to_pass": F2P},
        "issue": 17,
    }
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    task = load_suite(tmp_path / "rows.jsonl")["shapes-1"]
    assert (task.workspace / "shapes" / "geometry.py").read_text() == BUGGY
    assert dict(task.data) == {"issue": 17}
    full = execution(task, tmp_path, "e0", FIXED)
    assert assess(task, full, make_terminated).reward == 1.0


def test_junit_keys_follow_pytests_report():
    assert junit_key("a/b/test_c.py::test_d") == ("a.b.test_c", "test_d")
    assert junit_key("test_c.py::TestE::test_f[x/y::z]") == ("test_c.TestE", "test_f[x/y::z]")


def test_junit_keys_match_a_real_pytest_report(tmp_path):
    """A class, parameters holding '/' and '::', and an error in teardown after a pass,
    as pytest itself reports them."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "test_k.py").write_text(
        textwrap.dedent("""
            import pytest

            @pytest.fixture
            def breaks_on_teardown():
                yield
                raise RuntimeError("teardown")

            class TestE:
                @pytest.mark.parametrize("v", ["x/y::z"])
                def test_f(self, v):
                    pass

            def test_g(breaks_on_teardown):
                pass
        """)
    )
    report = tmp_path / "r.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".",
            "--junitxml", str(report), "pkg/test_k.py"]  # fmt: skip
    subprocess.run(argv, cwd=tmp_path, capture_output=True)
    assert junit_outcomes(report, 1, "") == {
        junit_key("pkg/test_k.py::TestE::test_f[x/y::z]"): "passed",
        junit_key("pkg/test_k.py::test_g"): "error",  # passed, then its teardown failed
    }


def test_a_test_reported_twice_keeps_its_failure(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"><failure/></testcase>'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><skipped/>'
        "</testcase></testsuite></testsuites>"
    )
    assert junit_outcomes(report, 1, "") == {("t", "a"): "failed", ("t", "b"): "skipped"}
    for rc in (3, 4):  # pytest's internal or usage error: the report is not trusted
        with pytest.raises(EvaluatorError, match=f"pytest failed \\(exit {rc}\\)"):
            junit_outcomes(report, rc, "")
    with pytest.raises(EvaluatorError, match="without a readable report"):
        junit_outcomes(tmp_path / "missing.xml", 1, "")


def test_the_runner_says_when_pytest_cannot_be_imported(monkeypatch, capsys):
    from gyre.tasks import pytest_runner

    monkeypatch.setitem(sys.modules, "pytest", None)  # `import pytest` raises ImportError
    assert pytest_runner.main(["--junitxml", "r.xml", "--per-test-timeout", "1", "t.py"]) == 97
    assert f"pytest cannot be imported by {sys.executable}" in capsys.readouterr().err


def test_a_conftest_hook_that_reports_passes_is_undone(tmp_path, source, make_terminated):
    """The work adds a conftest.py whose hook turns every failure into a pass: the scratch
    copy's test machinery is the initial state's, so the unfixed code still scores 1/3."""
    task = load_suite(write_suite(tmp_path, source["bug"]))["shapes"]
    ws = execution(task, tmp_path, "e0")
    hook = (
        "import pytest\n\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    for place in (ws / "conftest.py", ws / "tests" / "conftest.py"):
        place.parent.mkdir(exist_ok=True)
        place.write_text(hook)
    (ws / "pytest.ini").write_text("[pytest]\naddopts = -p no:junitxml\n")
    assert assess(task, ws, make_terminated).reward == pytest.approx(1 / 3)
    assert (ws / "conftest.py").exists()  # the preserved workspace itself is not touched
