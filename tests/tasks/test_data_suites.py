"""Data-file suites (JSONL, Parquet) and the `python` scoring rule, against real files and
real scoring subprocesses."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gyre.errors import ConfigError
from gyre.tasks import Evaluator, EvaluatorError, Validity, builtin_suite, load_suite
from gyre.tasks.scoring import python, scoring_env
from gyre.tasks.suite import ScoringConfig
from gyre.vocabulary import VerdictStatus

EXAMPLES = Path(__file__).parents[2] / "gyre" / "tasks" / "examples"

# Reward functions of the test suites; `echo` returns whatever the row's data says to.
REWARD = """
import os, time

def exact(workspace, data):
    given = (workspace / "answer.txt").read_text().strip()
    return 1.0 if given == data["answer"] else 0.0

def echo(workspace, data):
    return data["returned"]

def raises(workspace, data):
    raise ValueError("no answer key " + repr(sorted(data)))

def exits(workspace, data):
    raise SystemExit(0)

def nan(workspace, data):
    return float("nan")

def not_json(workspace, data):
    return object()

def sleepy(workspace, data):
    time.sleep(30)

def snoop(workspace, data):
    (workspace / "answer.txt").write_text("scribbled by the scorer")
    return {"score": 0.5, "detail": {"env": sorted(os.environ), "cwd": os.getcwd(),
                                     "data": data}}
"""

SIDECAR = """
name: quiz
defaults:
  workspace: shared
  scoring: {rule: python, function: "reward.py:exact", timeout_s: 20}
  tool_latency: {dist: fixed, seconds: 0.25}
"""

ROWS = [
    {"id": "q1", "instruction": "Add 2 and 2.", "answer": "4", "tags": ["math"]},
    {"id": 7, "instruction": "Name a colour.", "answer": "red", "workspace": "other"},
    {
        "name": "custom",
        "instruction": "Write ok.",
        "answer": "ok",
        "difficulty": "hard",
        "scoring": {"rule": "command", "command": ["true"]},
    },
]


def write_suite(root: Path, rows: list, *, sidecar: str | None = SIDECAR, name="quiz.jsonl"):
    """A data suite in `root`: the rows, a sidecar, reward.py and three workspaces."""
    for ws in ("shared", "other", "workspace"):
        (root / ws).mkdir(exist_ok=True)
        (root / ws / "README.md").write_text("Answer in answer.txt.\n")
    (root / "reward.py").write_text(REWARD)
    if sidecar is not None:
        (root / f"{Path(name).stem}.suite.yaml").write_text(sidecar)
    path = root / name
    if path.suffix == ".parquet":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys}), path)
    else:
        path.write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    return path


def test_jsonl_rows_become_tasks_with_their_data(tmp_path):
    suite = load_suite(write_suite(tmp_path, ROWS))
    assert suite.name == "quiz" and suite.names() == ["q1", "7", "custom"]
    q1, seven, custom = suite.tasks
    assert q1.instruction == "Add 2 and 2." and q1.suite == "quiz"
    assert dict(q1.data) == {"answer": "4", "tags": ["math"]}  # no task keys, no id
    assert q1.workspace == (tmp_path / "shared").resolve()
    assert seven.workspace == (tmp_path / "other").resolve()
    assert q1.scoring.rule == "python"
    assert q1.scoring.function == f"{(tmp_path / 'reward.py').resolve()}:exact"
    assert q1.tool_latency.dist == "fixed" and q1.tool_latency.seconds == 0.25
    assert custom.scoring.rule == "command" and custom.difficulty == "hard"
    assert dict(custom.data) == {"answer": "ok"}
    # the harness must see neither the reward function nor the data file (every answer)
    assert q1.hidden_paths == (
        (tmp_path / "reward.py").resolve(),
        (tmp_path / "quiz.jsonl").resolve(),
    )


def test_parquet_suite_loads_like_the_same_rows_in_jsonl(tmp_path):
    (tmp_path / "j").mkdir()
    (tmp_path / "p").mkdir()
    from_jsonl = load_suite(write_suite(tmp_path / "j", ROWS))
    # a column has one type (the ids are strings); the scoring column is a struct, whose
    # keys a row does not set read back as null, like the rows without a scoring at all
    rows = [{**r, "id": str(r["id"])} if "id" in r else r for r in ROWS]
    from_parquet = load_suite(write_suite(tmp_path / "p", rows, name="quiz.parquet"))
    assert from_parquet.names() == from_jsonl.names()
    for a, b in zip(from_jsonl, from_parquet, strict=True):
        assert (a.instruction, a.data, a.difficulty) == (b.instruction, b.data, b.difficulty)
        assert a.workspace.relative_to(tmp_path / "j") == b.workspace.relative_to(tmp_path / "p")
        assert (a.scoring.rule, a.scoring.command) == (b.scoring.rule, b.scoring.command)


def test_saved_hugging_face_dataset_loads_like_the_same_rows_in_jsonl(tmp_path):
    """A directory written by `datasets`' save_to_disk is a suite (its sidecar sits beside it,
    named after the directory); a DatasetDict's split is chosen in the sidecar."""
    import datasets

    (tmp_path / "j").mkdir()
    (tmp_path / "d").mkdir()
    from_jsonl = load_suite(write_suite(tmp_path / "j", ROWS))
    rows = [{**r, "id": str(r["id"])} if "id" in r else r for r in ROWS]  # one type per column
    write_suite(tmp_path / "d", [], name="quiz-ds.jsonl")  # workspaces, reward.py, sidecar
    (tmp_path / "d" / "quiz-ds.jsonl").unlink()
    columns = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys (null: absent)

    def dataset(rows: list) -> datasets.Dataset:
        return datasets.Dataset.from_dict({k: [r.get(k) for r in rows] for k in columns})

    dataset(rows).save_to_disk(str(tmp_path / "d" / "quiz-ds"))
    from_dataset = load_suite(tmp_path / "d" / "quiz-ds")
    assert from_dataset.name == "quiz" and from_dataset.names() == from_jsonl.names()
    for a, b in zip(from_jsonl, from_dataset, strict=True):
        assert (a.instruction, a.data, a.difficulty) == (b.instruction, b.data, b.difficulty)
        assert a.workspace.relative_to(tmp_path / "j") == b.workspace.relative_to(tmp_path / "d")
        assert (a.scoring.rule, a.scoring.command) == (b.scoring.rule, b.scoring.command)
    # the dataset directory holds every answer: hidden like a data file
    assert (tmp_path / "d" / "quiz-ds").resolve() in from_dataset.tasks[0].hidden_paths

    # several splits: the sidecar names one; none or an unknown one is a clear error
    splits = datasets.DatasetDict({"train": dataset(rows[:2]), "test": dataset(rows[:1])})
    splits.save_to_disk(str(tmp_path / "d" / "quiz-splits"))
    sidecar = tmp_path / "d" / "quiz-splits.suite.yaml"
    sidecar.write_text(SIDECAR + "split: test\n")
    suite = load_suite(tmp_path / "d" / "quiz-splits")
    assert suite.names() == ["q1"]
    sidecar.write_text(SIDECAR)
    with pytest.raises(ConfigError, match="holds the splits test, train and no split is chosen"):
        load_suite(tmp_path / "d" / "quiz-splits")
    sidecar.write_text(SIDECAR + "split: dev\n")
    with pytest.raises(ConfigError, match="split 'dev' is not one of them"):
        load_suite(tmp_path / "d" / "quiz-splits")
    (tmp_path / "j" / "quiz.suite.yaml").write_text(SIDECAR + "split: test\n")
    with pytest.raises(ConfigError, match="which is not a saved dataset"):
        load_suite(tmp_path / "j" / "quiz.jsonl")


def test_a_saved_dataset_without_the_datasets_package_is_one_clear_error(tmp_path, monkeypatch):
    import datasets

    datasets.Dataset.from_dict({"instruction": ["Do it."]}).save_to_disk(str(tmp_path / "ds"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    with pytest.raises(ConfigError, match=r"needs the `datasets` package \(pip install"):
        load_suite(tmp_path / "ds")


def test_rows_without_sidecar_ids_or_values(tmp_path):
    rows = [{"instruction": "Do it.", "scoring": {"rule": "command", "command": ["true"]}}] * 2
    rows[1] = {**rows[1], "workspace": None, "tool_latency": None, "hint": None}  # null: absent
    suite = load_suite(write_suite(tmp_path, rows, sidecar=None, name="plain.jsonl"))
    assert suite.name == "plain" and suite.names() == ["plain-0", "plain-1"]
    for task in suite:
        assert task.data == () and task.tool_latency.dist == "none"
        assert task.workspace == (tmp_path / "workspace").resolve()


def test_shipped_example_suites_agree_and_hide_their_answers():
    jsonl, parquet = (
        load_suite(EXAMPLES / "answers.jsonl"),
        load_suite(EXAMPLES / "answers.parquet"),
    )
    assert jsonl.names() == parquet.names() == ["multiply", "capital", "reverse", "prime"]
    for a, b in zip(jsonl, parquet, strict=True):
        same = {"source": None, "suite_hidden": ()}
        assert dataclasses.replace(a, **same) == dataclasses.replace(b, **same)
        assert a.scoring.rule == "python" and "answer" in dict(a.data)
        assert a.source in a.hidden_paths and (EXAMPLES / "reward.py").resolve() in a.hidden_paths
        # the other format holds the same answers: hidden from both suites' harnesses
        assert b.source in a.hidden_paths and a.source in b.hidden_paths
        assert dict(a.data)["answer"] not in a.instruction


def test_a_task_hides_every_other_tasks_secrets_of_its_suite():
    suite = builtin_suite()
    for task in suite:
        for other in suite:
            assert set(other.own_hidden_paths) <= set(task.hidden_paths), (task.name, other.name)


def row(name: str = "a", **keys):
    return {"id": name, "instruction": "x", **keys}


def python_rule(function: str, **keys):
    return {"rule": "python", "function": function, **keys}


@pytest.mark.parametrize(
    ("rows", "sidecar", "match"),
    [
        ([{"id": "a"}], SIDECAR, r"quiz.jsonl:1.instruction: required key is missing"),
        (
            [row(), row("b", scoring=python_rule("reward.py:exact", timeout=3))],
            SIDECAR,
            r"quiz.jsonl:2.scoring: unknown key 'timeout'; allowed keys: agentic, command, fail_to_pass, function, judge",
        ),
        (
            [row(workspace="gone")],
            SIDECAR,
            r"quiz.jsonl:1.workspace: initial state .*gone' does not exist",
        ),
        (
            [row(scoring=python_rule("shared/r.py:f"))],
            SIDECAR,
            r"quiz.jsonl:1.scoring.function: .*r.py' lies inside the workspace",
        ),
        (
            [row(scoring=python_rule("nope.py:f"))],
            SIDECAR,
            r"quiz.jsonl:1.scoring.function: .*nope.py' does not exist",
        ),
        (
            [row(scoring=python_rule("r.py"))],
            SIDECAR,
            r"quiz.jsonl:1.scoring.function: 'r.py' for rule 'python'; allowed: 'file.py:function'",
        ),
        (
            [row(), row("b"), {"name": "a", "instruction": "z"}],
            SIDECAR,
            r"quiz.jsonl:3.name: task name 'a' appears twice \(first in quiz.jsonl:1\)",
        ),
        ([row()], None, r"quiz.jsonl:1.scoring: required key is missing"),
        (
            [row()],
            "defaults: {scoring: {rule: python}}",
            r"quiz.suite.yaml.defaults.scoring.function: '' for rule 'python'",
        ),
        ([row()], "defaults: {tasks: []}", r"quiz.suite.yaml.defaults: unknown key 'tasks'"),
        ([], SIDECAR, r"quiz.jsonl' holds no rows"),
    ],
)
def test_bad_rows_name_the_file_the_row_and_the_key(tmp_path, rows, sidecar, match):
    path = write_suite(tmp_path, rows, sidecar=sidecar)
    (tmp_path / "shared" / "r.py").write_text(REWARD)
    with pytest.raises(ConfigError, match=match):
        load_suite(path)


def test_bad_lines_and_parquet_rows(tmp_path):
    path = write_suite(tmp_path, [{"id": "a", "instruction": "x"}])
    path.write_text(path.read_text() + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"quiz.jsonl:3: not valid JSON"):
        load_suite(path)
    path.write_text('{"id": "a", "instruction": "x"}\n["a list"]\n')
    with pytest.raises(ConfigError, match=r"quiz.jsonl:2: \['a list'\] is not a task"):
        load_suite(path)
    rows = [{"id": "a", "instruction": "x"}, {"id": "b", "instruction": "y", "difficulty": "?"}]
    with pytest.raises(ConfigError, match=r"quiz.parquet\[1\].difficulty: '\?' is not allowed"):
        load_suite(write_suite(tmp_path, rows, name="quiz.parquet"))
    rows = [{"id": "a", "instruction": "x", "when": datetime.datetime(2026, 1, 1)}]
    with pytest.raises(ConfigError, match=r"quiz.parquet\[0\].data.when: .* is not a JSON value"):
        load_suite(write_suite(tmp_path, rows, name="quiz.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"junk.parquet' is not a readable Parquet file"):
        load_suite(tmp_path / "junk.parquet")


# ---- the python rule ----------------------------------------------------------------------


@pytest.fixture
def quiz(tmp_path):
    """A one-row suite scored by reward.py:exact (the row's answer: "4")."""
    root = tmp_path / "suite"
    root.mkdir()
    rows = [{"id": "q", "instruction": "Add 2 and 2; write the sum to answer.txt.", "answer": "4"}]
    return load_suite(write_suite(root, rows))["q"]


def with_function(task, name: str, **data):
    file = task.scoring.function.rpartition(":")[0]
    scoring = dataclasses.replace(task.scoring, function=f"{file}:{name}")
    return dataclasses.replace(task, scoring=scoring, data=tuple(data.items()) or task.data)


def workspace_with(tmp_path: Path, answer: str | None) -> Path:
    ws = tmp_path / "exec" / "workspace"
    ws.mkdir(parents=True)
    if answer is not None:
        (ws / "answer.txt").write_text(answer)
    return ws


@pytest.mark.parametrize(
    ("answer", "reward", "match"),
    [
        ("391\n", 1.0, "exact"),
        ("  THE answer is 391.", 0.5, "contains"),
        ("391.", 0.5, "contains"),
        ("3910", 0.1, "wrong"),
        (None, 0.0, "missing"),
    ],
)
def test_example_reward_gives_partial_credit_through_the_evaluator(
    tmp_path, make_terminated, answer, reward, match
):
    task = load_suite(EXAMPLES / "answers.jsonl")["multiply"]
    verdict = asyncio.run(
        Evaluator().assess(make_terminated(workspace_with(tmp_path, answer)), task)
    )
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == reward
    assert verdict.assessment.detail == {"match": match} and verdict.assessment.critique


def test_a_raising_reward_function_leaves_the_assessment_unresolved(
    quiz, tmp_path, make_terminated
):
    ws = workspace_with(tmp_path, "4")
    ev = Evaluator(Evaluator.Config(retry_backoff_s=0.0, max_attempts=2))
    verdict = asyncio.run(ev.assess(make_terminated(ws), with_function(quiz, "raises")))
    assert (
        verdict.status is VerdictStatus.EXCLUDED
        and verdict.reward is None
        and verdict.attempts == 2
    )
    for a in ev.log.for_execution("e0"):
        assert a.validity is Validity.UNRESOLVED and a.score is None
        assert "reward.py:raises failed: ValueError: no answer key ['answer']" in a.error
    assert asyncio.run(python(ws, quiz)).value == 1.0  # the same state, a working function


@pytest.mark.parametrize(
    ("function", "returned", "match"),
    [
        ("echo", 2.0, r"returned score 2.0; allowed: a number in \[0, 1\]"),
        ("echo", -0.25, "returned score -0.25"),
        ("echo", "1", "returned score '1'"),
        ("echo", True, "returned score True"),
        ("echo", None, "returned score None"),
        ("echo", [0.5], r"returned score \[0.5\]"),
        ("echo", {"detail": {}}, "returned score None"),
        ("echo", {"score": 0.5, "extra": 1}, r"returned \{'score': 0.5, 'extra': 1\}"),
        ("echo", {"score": 0.5, "detail": "x"}, "returned {'score'"),
        ("echo", {"score": 0.5, "critique": 3}, "returned {'score'"),
        ("nan", None, "not JSON"),
        ("not_json", None, "not JSON"),
        ("exits", None, "reward.py:exits failed: SystemExit"),
        ("missing", None, "reward.py defines no function 'missing'"),
    ],
)
def test_bad_returns_are_evaluator_errors(quiz, tmp_path, function, returned, match):
    task = with_function(quiz, function, returned=returned)
    with pytest.raises(EvaluatorError, match=match):
        asyncio.run(python(workspace_with(tmp_path, "4"), task))


def test_a_valid_mapping_and_integers_are_scores(quiz, tmp_path):
    ws = workspace_with(tmp_path, "4")
    full = {"score": 1, "detail": {"k": [1]}, "critique": "fine"}
    score = asyncio.run(python(ws, with_function(quiz, "echo", returned=full)))
    assert (score.value, score.detail, score.critique) == (1.0, {"k": [1]}, "fine")
    assert asyncio.run(python(ws, with_function(quiz, "echo", returned=0))).value == 0.0


def test_reward_function_runs_in_the_scratch_copy_with_the_minimal_env(
    quiz, tmp_path, make_terminated, monkeypatch
):
    monkeypatch.setenv("GYRE_TEST_SECRET", "do-not-leak")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    ws = workspace_with(tmp_path, "4")
    verdict = asyncio.run(Evaluator().assess(make_terminated(ws), with_function(quiz, "snoop")))
    assert verdict.status is VerdictStatus.SCORED and verdict.reward == 0.5
    detail = verdict.assessment.detail
    assert "GYRE_TEST_SECRET" not in detail["env"] and "OPENAI_API_KEY" not in detail["env"]
    assert detail["env"] == sorted(scoring_env(tmp_path))  # only PATH, HOME, LANG, ...
    assert Path(detail["cwd"]) != ws.resolve()  # a scratch copy, not the live workspace
    assert detail["data"] == {"answer": "4"}
    assert (ws / "answer.txt").read_text() == "4"  # its scribble never reached the live state


def test_a_hanging_reward_function_times_out(quiz, tmp_path):
    task = with_function(quiz, "sleepy")
    task = dataclasses.replace(task, scoring=dataclasses.replace(task.scoring, timeout_s=0.5))
    with pytest.raises(EvaluatorError, match=r"timed out after 0\.5s"):
        asyncio.run(python(workspace_with(tmp_path, "4"), task))


def test_python_rule_needs_a_function():
    with pytest.raises(ConfigError, match=r"function: '' for rule 'python'"):
        ScoringConfig(rule="python")
    with pytest.raises(ConfigError, match=r"function: 'reward.py:1x'"):
        ScoringConfig(rule="python", function="reward.py:1x")


def test_yaml_tasks_carry_data_for_the_python_rule(tmp_path):
    write_suite(tmp_path, [], sidecar=None)
    (tmp_path / "s.yaml").write_text(
        textwrap.dedent("""
        tasks:
          - name: a
            instruction: Write 4 to answer.txt.
            scoring: {rule: python, function: "reward.py:exact"}
            data: {answer: "4"}
        """)
    )
    task = load_suite(tmp_path / "s.yaml")["a"]
    assert dict(task.data) == {"answer": "4"}
    assert asyncio.run(python(workspace_with(tmp_path, "4"), task)).value == 1.0
