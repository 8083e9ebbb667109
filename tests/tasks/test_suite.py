"""Task suites: the built-in suite, YAML and directory formats, and bad input."""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import statistics
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.tasks import ToolLatency, load_suite
from gyre.tasks.suite import BUILTIN_DIR


def test_builtin_suite_has_a_spread_of_real_tasks(suite):
    assert len(suite) >= 8
    assert {t.difficulty for t in suite} == {"easy", "medium", "hard"}
    sizes = {t.name: sum(1 for p in t.workspace.rglob("*") if p.is_file()) for t in suite}
    assert max(sizes.values()) >= 3  # at least one multi-file task
    for task in suite:
        tests = Path(task.scoring.tests)
        assert task.scoring.rule == "hidden_tests"
        assert tests.is_file() and not tests.is_relative_to(task.workspace)
        assert not any(p.name.startswith("test_") for p in task.workspace.rglob("*"))
        assert task.tool_latency.dist == "lognormal"  # suite default: a long tail


def write_task(root: Path, name: str = "t1", **overrides: str) -> Path:
    d = root / name
    (d / "workspace").mkdir(parents=True)
    (d / "workspace" / "m.py").write_text("X = 1\n")
    (d / "hidden").mkdir()
    (d / "hidden" / "test_m.py").write_text("from m import X\n\ndef test_x():\n    assert X == 2\n")
    body = {
        "instruction": "Set X to 2 in m.py.",
        "scoring": "{rule: hidden_tests, tests: hidden/test_m.py}",
    }
    body.update(overrides)
    (d / "task.yaml").write_text("".join(f"{k}: {v}\n" for k, v in body.items()))
    return d


def test_directory_suite(tmp_path):
    write_task(tmp_path, "a")
    write_task(tmp_path, "b", difficulty="hard")
    s = load_suite(tmp_path)
    assert s.names() == ["a", "b"]
    assert s["b"].difficulty == "hard"
    assert s["a"].workspace == (tmp_path / "a" / "workspace").resolve()
    assert s["a"].tool_latency.dist == "none"


def test_yaml_suite_file_with_defaults(tmp_path):
    write_task(tmp_path, "a")
    (tmp_path / "s.yaml").write_text(
        textwrap.dedent(
            """
            name: mine
            defaults:
              tool_latency: {dist: fixed, seconds: 0.5}
            tasks:
              - name: first
                instruction: Set X to 2.
                workspace: a/workspace
                scoring: {rule: hidden_tests, tests: a/hidden/test_m.py}
              - name: second
                instruction: Set X to 2.
                workspace: a/workspace
                scoring: {rule: command, command: [python, -c, "print(1.0)"]}
                tool_latency: {dist: uniform, low: 0.1, high: 0.2}
            """
        )
    )
    s = load_suite(tmp_path / "s.yaml")
    assert s.name == "mine" and len(s) == 2
    assert s["first"].tool_latency.seconds == 0.5
    assert s["second"].tool_latency.dist == "uniform"
    assert s["second"].scoring.command == ["python", "-c", "print(1.0)"]


def test_missing_initial_state_is_a_clear_error(tmp_path):
    d = write_task(tmp_path, "broken")
    shutil.rmtree(d / "workspace")
    with pytest.raises(
        ConfigError, match=r"broken/task.yaml.workspace: initial state .* does not exist"
    ):
        load_suite(tmp_path)


BAD_TASKS = {  # case: (task.yaml fields, the error it must raise)
    "unknown-scoring-rule-names-the-allowed-rules": (
        {"scoring": "{rule: vibes}"},
        r"t/task.yaml.scoring.rule: 'vibes' .*allowed: command, hidden_tests",
    ),
    "missing-hidden-tests-file": (
        {"scoring": "{rule: hidden_tests, tests: hidden/nope.py}"},
        r"scoring.tests: .*nope.py' does not exist",
    ),
    "hidden-tests-inside-the-workspace": (
        {"scoring": "{rule: hidden_tests, tests: workspace/m.py}"},
        "inside the workspace",
    ),
    "unknown-key": (
        {"colour": "blue"},
        r"unknown key 'colour'; allowed keys: data, difficulty, instruction",
    ),
    "bad-difficulty": ({"difficulty": "impossible"}, r"difficulty: 'impossible' is not allowed"),
}


@pytest.mark.parametrize(("fields", "error"), BAD_TASKS.values(), ids=BAD_TASKS)
def test_bad_task_yaml_is_a_clear_error(tmp_path, fields, error):
    d = write_task(tmp_path, "t", **fields)
    assert (d / "workspace" / "m.py").exists()  # the file a case may name as its tests
    with pytest.raises(ConfigError, match=error):
        load_suite(tmp_path)


def test_duplicate_names_and_missing_suite(tmp_path):
    write_task(tmp_path, "a")
    (tmp_path / "suite.yaml").write_text(
        "tasks:\n  - {name: a, instruction: x, workspace: a/workspace, "
        "scoring: {rule: hidden_tests, tests: a/hidden/test_m.py}}\n"
    )
    with pytest.raises(ConfigError, match="'a' appears twice"):
        load_suite(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_suite(tmp_path / "nowhere.yaml")


def test_builtin_dir_is_shipped_next_to_the_code():
    assert (BUILTIN_DIR / "suite.yaml").is_file()


LATENCY = {  # a ToolLatency's fields: its distribution, two bounds, mu and the cap
    "dist": st.sampled_from(["none", "fixed", "uniform", "lognormal"]),
    "a": st.floats(0, 5),
    "b": st.floats(0, 5),
    "mu": st.floats(-5, 3),
    "cap": st.floats(0, 10),
}


@settings(max_examples=200, deadline=None)
@given(**LATENCY, sigma=st.floats(0, 3), seed=st.integers(0, 2**32))
def test_tool_latency_samples_stay_in_bounds(dist, a, b, mu, sigma, cap, seed):
    lo, hi = min(a, b), max(a, b)
    lat = ToolLatency(dist=dist, seconds=a, low=lo, high=hi, mu=mu, sigma=sigma, max_s=cap)
    x = lat.sample(random.Random(seed))
    assert 0.0 <= x <= cap
    if dist == "none":
        assert x == 0.0
    if dist == "fixed":
        assert x == min(a, cap)
    if dist == "uniform":
        assert lo <= x <= min(hi, cap) or x == cap


def test_lognormal_latency_has_a_long_tail():
    lat = ToolLatency(dist="lognormal", mu=-2.0, sigma=1.0, max_s=100.0)
    rng = random.Random(0)
    xs = [lat.sample(rng) for _ in range(4000)]
    assert abs(statistics.median(xs) - 0.1353) < 0.015  # exp(mu)
    assert max(xs) > 10 * statistics.median(xs)


def test_tool_latency_rejects_bad_values():
    with pytest.raises(ConfigError, match=r"sigma: -1\.0 must be"):
        ToolLatency(dist="lognormal", sigma=-1.0)
    with pytest.raises(ConfigError, match=r"high: 1\.0 must be >= low"):
        ToolLatency(dist="uniform", low=2.0, high=1.0)


@settings(max_examples=100, deadline=None)
@given(
    **LATENCY,
    qs=st.floats(0, 2),
    es=st.floats(0, 2),
    hard=st.floats(0, 1),
    hf=st.floats(0.1, 8),
    query=st.text(max_size=8),
    seed=st.integers(0, 2**32),
)
def test_an_executions_latency_is_the_base_draw_times_its_factor(
    dist, a, b, mu, cap, qs, es, hard, hf, query, seed
):
    """Against the obvious reference: one execution's latency draws what the base one
    draws, times the execution's factor, then capped; and it has no factor left to draw."""
    lo, hi = min(a, b), max(a, b)
    base = ToolLatency(dist=dist, seconds=a, low=lo, high=hi, mu=mu, sigma=0.7, max_s=cap,
                       query_sigma=qs, execution_sigma=es, hard_query_prob=hard,
                       hard_query_factor=hf)  # fmt: skip
    f = base.factor(query, "g0-e1")
    own = base.for_execution(query, "g0-e1")
    uncapped = dataclasses.replace(base, max_s=1e300).sample(random.Random(seed))
    assert own.sample(random.Random(seed)) == pytest.approx(min(cap, f * uncapped), rel=1e-9)
    assert own.factor(query, "g0-e1") == 1.0


def test_a_querys_executions_share_its_difficulty_and_hard_queries_are_hard_together():
    lat = ToolLatency(dist="fixed", seconds=1.0, query_sigma=0.3, hard_query_prob=0.25,
                      hard_query_factor=4.0)  # fmt: skip
    queries = [f"learn/notes/{i}" for i in range(2000)]
    per_query = [{lat.factor(q, f"g0-e{e}") for e in range(4)} for q in queries]
    assert all(len(f) == 1 for f in per_query)  # no execution spread: one factor a group
    logs = [math.log(f.pop()) for f in per_query]
    hard = [x > math.log(4.0) / 2 for x in logs]
    assert 0.21 < sum(hard) / len(logs) < 0.29  # the hard share
    easy = [x for x, h in zip(logs, hard) if not h]
    assert statistics.pstdev(easy) == pytest.approx(0.3, rel=0.1)  # the query spread
    # and the same query is as hard in every run (its name decides, not the process)
    assert lat.factor(queries[0], "g9-e0") == lat.factor(queries[0], "g0-e0")


def test_executions_of_one_query_spread_by_their_own_factor():
    lat = ToolLatency(dist="fixed", seconds=1.0, execution_sigma=0.5)
    logs = [
        math.log(lat.factor("learn/notes/7", f"g{g}-e{e}")) for g in range(500) for e in range(4)
    ]
    assert statistics.fmean(logs) == pytest.approx(0.0, abs=0.05)
    assert statistics.pstdev(logs) == pytest.approx(0.5, rel=0.1)
    assert lat.factor("learn/notes/7", "g0-e0") != lat.factor("learn/notes/8", "g0-e0")


def test_latency_factors_reject_bad_values():
    with pytest.raises(ConfigError, match=r"hard_query_prob: 1\.5 must be in 0\.\.1"):
        ToolLatency(hard_query_prob=1.5)
    with pytest.raises(ConfigError, match=r"hard_query_factor: 0\.0 must be a finite number > 0"):
        ToolLatency(hard_query_factor=0.0)
    with pytest.raises(ConfigError, match=r"execution_sigma: -0\.1 must be"):
        ToolLatency(execution_sigma=-0.1)
