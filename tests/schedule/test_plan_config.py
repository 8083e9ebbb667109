"""`gyre plan` against a brute-force reference, and config validation messages."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.cli import main
from gyre.errors import ConfigError
from gyre.schedule import (
    Config,
    PolicyConfig,
    Scheduler,
    expected_staleness,
    make_policy,
    plan,
    plan_for,
)


def reference_elastic(e: float, min_phi: float) -> tuple[float, int]:
    """Longest burst whose φ = E - (μ-1)/2 stays >= min_phi, by enumeration."""
    best = (e, 1)
    for mu in range(1, 200):
        phi = e - (mu - 1) / 2
        if phi >= min_phi - 1e-9:
            best = (phi, mu)
    return best


@given(half_steps=st.integers(0, 20), min_phi=st.sampled_from([0.0, 0.5, 1.0]))
def test_plan_matches_reference_and_identity(half_steps: int, min_phi: float) -> None:
    e = half_steps / 2
    plans = {p.policy: p for p in plan(e, min_phi)}
    assert set(plans) == {"elastic", "async", "colocate"}
    assert (plans["async"].phi, plans["async"].mu) == (e, 1)
    assert (plans["colocate"].phi, plans["colocate"].mu) == (0.0, half_steps + 1)
    phi, mu = reference_elastic(e, min_phi)
    assert plans["elastic"].mu == mu
    assert plans["elastic"].phi == pytest.approx(phi)
    for p in plans.values():
        assert expected_staleness(p.phi, p.mu) == pytest.approx(e)


def test_paper_settings() -> None:
    assert (plan_for("elastic", 1.5).phi, plan_for("elastic", 1.5).mu) == (0.5, 3)
    assert plan_for("colocate", 1.5).mu == 4
    assert plan_for("async", 1.0).phi == 1.0


def test_plan_rejects_bad_targets() -> None:
    with pytest.raises(ConfigError, match="staleness"):
        plan(-1.0)
    with pytest.raises(ConfigError, match=r"steps of 0\.5"):
        plan_for("colocate", 0.75)


def test_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--staleness", "1.5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    assert {r["policy"]: (r["phi"], r["mu"]) for r in rows} == {
        "elastic": (0.5, 3),
        "async": (1.5, 1),
        "colocate": (0.0, 4),
    }
    assert main(["plan", "--staleness", "-2"]) == 2
    assert "staleness" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"phi": -0.5}, "phi: -0.5 is negative; allowed φ >= 0"),
        ({"mu": 0}, "mu: 0; allowed μ >= 1"),
        ({"cells": 40}, "cells: 40 is more than nodes (32)"),
        ({"train_layout_nodes": 8}, "train_layout_nodes: 8 does not fit a cell of 4 nodes"),
        ({"concurrency_per_cell": 0}, "concurrency_per_cell: 0; allowed: an integer >= 1"),
        ({"standalone_nodes": 3}, "standalone_nodes: 3; allowed: a multiple of the cell size"),
        ({"oversample": -1}, "oversample: -1; allowed: an integer >= 0"),
        ({"oversample": 1.5}, "oversample: 1.5; allowed: an integer >= 0"),
        ({"oversample": True}, "oversample: True; allowed: an integer >= 0"),
        ({"window": 0}, "window: 0; allowed: auto or an integer >= 1"),
        ({"window": -1}, "window: -1; allowed: auto or an integer >= 1"),
        ({"window": 1.5}, "window: 1.5; allowed: auto or an integer >= 1"),
        ({"window": "autoo"}, "window: 'autoo'; allowed: auto or an integer >= 1"),
        ({"window": True}, "window: True; allowed: auto or an integer >= 1"),
    ],
)
def test_bad_scheduler_config_names_key_and_allowed(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**changes)
    assert message in str(info.value)


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ConfigError, match="name: 'fifo' is unknown; allowed: elastic, async"):
        PolicyConfig(name="fifo")  # type: ignore[arg-type]


def test_window_auto_is_twice_the_pipeline_stages_and_a_number_is_kept() -> None:
    """`schedule.window` auto (the default): a cell of P > 1 pipeline stages claims up to 2P
    micro-steps a pass, an unpipelined one 1 (as before windows); a number is kept as given.
    A scheduler built on a config left at auto runs cells of one stage."""
    auto = Config()
    assert auto.window == "auto"
    assert [auto.window_for(p) for p in (1, 2, 4, 47)] == [1, 4, 8, 94]
    assert [Config(window=3).window_for(p) for p in (1, 4)] == [3, 3]
    assert Scheduler(auto, make_policy(auto, PolicyConfig())).window == 1
    resolved = Config(window=auto.window_for(4))
    assert Scheduler(resolved, make_policy(resolved, PolicyConfig())).window == 8
