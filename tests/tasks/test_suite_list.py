"""`harness.suite` as a list: one suite of every listed suite's tasks, each task's secrets
hidden from every other task's harness, names unique across the suites."""

from __future__ import annotations

import pytest

from gyre.errors import ConfigError
from gyre.runtime.shared.config import DEFAULT_CONFIG, load_run_config
from gyre.runtime.shared.harness import load_tasks
from gyre.tasks.suite import named_suite


def test_a_list_of_suites_is_one_suite_of_all_their_tasks() -> None:
    learn, builtin = named_suite("learn"), named_suite("builtin")
    both = named_suite(["learn", "builtin"])
    assert both.names() == learn.names() + builtin.names()
    assert both.name == "learn+builtin"
    # a harness on a learn task must not read a builtin task's hidden tests, and back
    add, notes = both["add"], both["notes"]
    assert set(add.own_hidden_paths) <= set(notes.hidden_paths)
    assert set(notes.own_hidden_paths) <= set(add.hidden_paths)
    cfg = load_run_config(DEFAULT_CONFIG, ["harness.suite=[learn, builtin]", "harness.tasks=[]"])
    assert load_tasks(cfg)[1] == both.names()  # harness.tasks empty: every task


def test_a_task_name_in_two_listed_suites_is_refused() -> None:
    with pytest.raises(ConfigError, match="task name 'notes' appears twice"):
        named_suite(["learn", "learn"])
    with pytest.raises(ConfigError, match=r"suite: \[\]; allowed"):
        named_suite([])


def test_eval_scores_its_own_suite_and_never_a_training_row_as_held_out() -> None:
    from gyre.runtime.evaluation import heldout

    cfg = load_run_config(DEFAULT_CONFIG)  # learn / notes: a family of instances
    run_cfg, names = heldout(cfg, None)
    assert (run_cfg.harness.suite, names) == ("learn", ["notes"])
    own = load_run_config(DEFAULT_CONFIG, ["eval.suite=builtin", "eval.tasks=[add, roman]"])
    run_cfg, names = heldout(own, None)
    assert (run_cfg.harness.suite, names) == ("builtin", ["add", "roman"])
    assert heldout(own, ["fizzbuzz"])[1] == ["fizzbuzz"]  # --tasks
    fixed = load_run_config(DEFAULT_CONFIG, ["harness.suite=builtin", "harness.tasks=[add]"])
    with pytest.raises(ConfigError, match=r"task.s. add have no variables"):
        heldout(fixed, None)
