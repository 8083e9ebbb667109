"""The simulator end to end: determinism, accounting, policy ordering, config errors, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gyre.cli import main
from gyre.errors import ConfigError
from gyre.schedule.config import Config
from gyre.schedule.events import Work
from gyre.sim import SimConfig, Simulator, load_sim_config
from gyre.sim.config import PolicySpec
from gyre.vocabulary import Outcome, Role

from .paths import TEMPLATE


def small(**changes: object) -> SimConfig:
    """The NL2RepoBench template shrunk to 8 nodes (4 cells), N = 4, B = 4."""
    cfg = load_sim_config(TEMPLATE)
    sched = dataclasses.replace(
        cfg.scheduler,
        nodes=8,
        cells=4,
        train_layout_nodes=2,
        concurrency_per_cell=8,
        group_size=4,
        batch_groups=4,
        join_min_microsteps=2,
    )
    policies = {"async": PolicySpec(train_cells=1, streaming=False)}
    return dataclasses.replace(cfg, scheduler=sched, policies=policies, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["elastic", "async", "colocate"])
def test_same_seed_same_result(policy: str) -> None:
    cfg = small(steps=6)
    a = Simulator(cfg, policy, seed=3).run()
    b = Simulator(cfg, policy, seed=3).run()
    c = Simulator(cfg, policy, seed=4).run()
    assert a.step_end_h == b.step_end_h and a.timeline == b.timeline
    assert a.mean_staleness == b.mean_staleness
    assert c.step_end_h != a.step_end_h


@pytest.mark.parametrize("oversample", [0, 2])
@pytest.mark.parametrize("policy", ["elastic", "async", "colocate"])
def test_every_launched_execution_ends_once_and_staleness_follows_identity(
    policy: str, oversample: int
) -> None:
    """... with oversampling too: N + k launched per group (less the withdrawn), N trained."""
    cfg = small(steps=40, staleness=1.0)
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, oversample=oversample)
    )
    sim = Simulator(cfg, policy)
    result = sim.run()
    s = sim.scheduler
    assert 0 <= s.f <= s.p <= s.d
    ended = sum(1 for t in sim.end_t if t >= 0)
    assert ended == s.f - s.withdrawn and result.executions == s.p - s.withdrawn
    assert s.d == len(s.groups) * (4 + oversample) and result.withdrawn == s.withdrawn
    assert all(len(m) == 4 for m in sim.members.values())  # N members per trained group
    assert (result.cancelled > 0) == (oversample > 0)
    assert result.expected_staleness == 1.0
    assert result.mean_staleness == pytest.approx(1.0, abs=0.1)
    assert result.ideal_h < result.total_h
    assert len(result.step_end_h) == 40 and result.step_end_h == sorted(result.step_end_h)
    if policy == "async":
        assert result.train_share[0] == pytest.approx(1.0)
        assert result.train_share[1:] == [0.0, 0.0, 0.0]


def test_elastic_beats_both_baselines_on_reduced_nl2repo() -> None:
    """12 NL2RepoBench-like steps at E[d] = 1.5 (the 48-step figures: tools/bench_sim.py)."""
    cfg = load_sim_config(TEMPLATE)
    hours = {p: Simulator(cfg, p, steps=12).run().total_h for p in ("elastic", "async", "colocate")}
    assert hours["elastic"] < hours["async"]
    assert hours["elastic"] < hours["colocate"]


def test_elastic_cells_enter_training_at_different_times() -> None:
    result = Simulator(small(steps=8), "elastic").run()
    first_train: dict[int, float] = {}
    for t, c, role in result.timeline:
        if role == "to_train":
            first_train.setdefault(c, t)
    assert first_train[0] == min(first_train.values())  # the core leaves first
    assert len(set(first_train.values())) > 1  # staggered, not a pool-wide switch
    assert result.train_share[0] >= result.train_share[-1]


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("scheduler: {phi: -1}", "nl2.scheduler.phi: -1.0 is negative; allowed φ >= 0"),
        ("scheduler: {mu: 0}", "nl2.scheduler.mu: 0; allowed μ >= 1"),
        ("scheduler: {cells: 64}", "nl2.scheduler.cells: 64 is more than nodes (32)"),
        ("scheduler: {train_layout_nodes: 8}", "train_layout_nodes: 8 does not fit a cell"),
        ("scheduler: {concurrency_per_cell: 0}", "concurrency_per_cell: 0; allowed"),
        ("policy: fifo", "nl2.policy: 'fifo' is unknown; allowed: elastic, async, colocate, all"),
        ("policies: {fifo: {}}", "policies.fifo: 'fifo' is unknown"),
        ("workload: {wat: 1}", "nl2.workload: unknown key 'wat'; allowed keys:"),
        ("steps: 0", "nl2.steps: 0; allowed >= 1"),
    ],
)
def test_bad_sim_config_is_rejected_with_key_and_allowed(
    tmp_path: Path, yaml_text: str, message: str
) -> None:
    path = tmp_path / "nl2.yaml"
    path.write_text(f"base: {TEMPLATE}\n{yaml_text}\n")
    with pytest.raises(ConfigError) as info:
        load_sim_config(path)
    assert message in str(info.value)


def test_policy_override_errors_name_the_policy() -> None:
    cfg = dataclasses.replace(small(), policies={"elastic": PolicySpec(cells=3)})
    with pytest.raises(ConfigError, match=r"policies\.elastic\.cells: 3 does not divide nodes"):
        cfg.scheduler_for("elastic")
    with pytest.raises(ConfigError, match="unknown"):
        cfg.scheduler_for("fifo")
    assert isinstance(cfg.scheduler_for("colocate")[0], Config)


def test_sim_cli_json_and_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "small.yaml"
    cfg.write_text(
        f"base: {TEMPLATE}\nscheduler: {{nodes: 8, cells: 4, train_layout_nodes: 2, "
        "concurrency_per_cell: 8, group_size: 4, batch_groups: 4}\n"
        "policies: {async: {train_cells: 1}}\n"
    )
    timeline = tmp_path / "timeline.json"
    argv = ["sim", str(cfg), "--policy", "all", "--steps", "3", "--seed", "1", "--json"]
    assert main([*argv, "--timeline", str(timeline)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"elastic", "async", "colocate"}
    assert set(out["speedup_over"]) == {"async", "colocate"}
    assert all(p["ideal_h"] > 0 for p in out["policies"].values())
    runs = json.loads(timeline.read_text())
    assert [r["policy"] for r in runs] == ["elastic", "async", "colocate"]
    assert runs[0]["timeline"] and len(runs[0]["step_end_h"]) == 3
    assert main(["sim", str(cfg), "--policy", "fifo"]) == 2
    assert "--policy: 'fifo' is unknown" in capsys.readouterr().err


def test_ablation_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--ablation", "C2", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["policies"]) == ["colocate"]
    assert out["policies"]["colocate"]["mu"] == 3
    assert main(["sim", "--ablation", "Z9"]) == 2
    assert "allowed: A0, A1" in capsys.readouterr().err


def test_every_table1_configuration_loads_and_runs_a_step() -> None:
    from gyre.sim.ablation import PAPER_TIME_OVER_E0, run_ablation

    for name in PAPER_TIME_OVER_E0:
        result = run_ablation(name, steps=1)
        assert result.steps == 1 and result.total_h > 0


def test_training_work_comes_from_sampled_tokens_not_wall_time() -> None:
    """The same group trains the same tokens under every policy, however long it ran."""
    cfg = small(steps=4)
    sims = {p: Simulator(cfg, p, seed=2) for p in ("elastic", "async")}
    for sim in sims.values():
        sim.run()
    a, b = sims["elastic"], sims["async"]
    both = [x for x in range(min(len(a.outcome), len(b.outcome)))
            if a.outcome[x] is b.outcome[x] is Outcome.COMPLETED]  # fmt: skip
    assert len(both) > 8
    differ = 0
    for x in both:
        assert a.full_tokens[x] == b.full_tokens[x]
        assert a.tokens[x] == pytest.approx(b.tokens[x]) == pytest.approx(a.full_tokens[x])
        differ += abs((a.end_t[x] - a.launch_t[x]) - (b.end_t[x] - b.launch_t[x])) > 1.0
    assert differ > len(both) // 4  # they ran at other speeds, and trained the same


def test_the_scheduler_learns_the_simulated_costs() -> None:
    sim = Simulator(small(steps=6), "elastic")
    sim.run()
    costs, est = sim.config.costs, sim.scheduler.costs
    assert est.switch_s(0, Role.TRAIN) == pytest.approx(costs.switch_to_train_s)
    assert est.switch_s(0, Role.ROLLOUT) == pytest.approx(costs.switch_to_rollout_s)
    assert est.gradient.count > 0 and est.pass_s(Work.GRADIENT) > est.pass_s(Work.PREPASS)


def test_satellites_stay_in_rollout_when_a_switch_costs_more_than_it_saves() -> None:
    """Switches that take longer than the batch's work: the cost-aware rule keeps the
    satellites serving; the paper's rule alone (payback 0) sends them and wastes switches."""
    slow = dataclasses.replace(small(steps=6).costs, switch_to_train_s=20_000.0)
    cfg = small(steps=6, costs=slow)
    aware = Simulator(cfg, "elastic").run()
    blind_sched = dataclasses.replace(cfg.scheduler, join_payback=0.0)
    blind = Simulator(dataclasses.replace(cfg, scheduler=blind_sched), "elastic").run()
    assert aware.wasted_switches == 0
    assert blind.wasted_switches > 0
    assert aware.switches < blind.switches
    assert aware.total_h < blind.total_h


def test_the_simulators_window_is_resolved_for_its_modelled_pipeline_stages() -> None:
    """`window: auto` in a sim template: 2 x `costs.pipeline_stages` micro-steps a pass where
    the modelled cells are pipelined, else 1; a number as given."""
    cfg = load_sim_config(TEMPLATE)
    assert cfg.scheduler.window == "auto" and cfg.costs.pipeline_stages == 1
    assert cfg.scheduler_for("elastic")[0].window == 1
    staged = dataclasses.replace(cfg, costs=dataclasses.replace(cfg.costs, pipeline_stages=3))
    assert [staged.scheduler_for(p)[0].window for p in ("elastic", "async")] == [6, 6]
    fixed = dataclasses.replace(staged, scheduler=dataclasses.replace(staged.scheduler, window=2))
    assert fixed.scheduler_for("elastic")[0].window == 2
