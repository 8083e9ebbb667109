"""Processor-sharing engines against a slow time-stepping reference; workload calibration."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.schedule.devices import EngineModel, EnginePool
from gyre.sim.config import load_sim_config
from gyre.sim.workload import nominal_stats

from .paths import TEMPLATE


def reference_finish_times(
    jobs: list[tuple[float, float]], pool: EnginePool, dt: float
) -> dict[int, float]:
    """Advance every running job by rate(load) * dt in small steps (slow, obvious)."""
    remaining: dict[int, float] = {}
    done: dict[int, float] = {}
    t = 0.0
    pending = sorted(enumerate(jobs), key=lambda j: j[1][0])
    while pending or remaining:
        while pending and pending[0][1][0] <= t + 1e-12:
            i, (_, work) = pending.pop(0)
            remaining[i] = work
        rate = pool.models[0].rate(len(remaining)) if remaining else 0.0
        for i in list(remaining):
            remaining[i] -= rate * dt
            if remaining[i] <= 1e-9:
                done[i] = t + dt
                del remaining[i]
        t += dt
    return done


@settings(max_examples=25, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 20).map(float), st.integers(1, 30).map(float)),
        min_size=1,
        max_size=6,
    )
)
def test_virtual_clock_matches_time_stepping(jobs: list[tuple[float, float]]) -> None:
    model = EngineModel(reference_load=4, half=2.0, generation_share=0.6)
    pool = EnginePool(1, model)
    ref = reference_finish_times(jobs, EnginePool(1, model), dt=0.001)
    # event-driven: arrivals and completions in time order
    arrivals = sorted(enumerate(jobs), key=lambda j: j[1][0])
    finish: dict[int, float] = {}
    now = 0.0
    while arrivals or pool.where:
        nxt = pool.next_completion(0)
        if arrivals and (nxt is None or arrivals[0][1][0] <= nxt[0]):
            i, (start, work) = arrivals.pop(0)
            now = start
            pool.add(i, 0, work, now)
        else:
            assert nxt is not None
            now, x = nxt
            pool.remove(x, now)
            finish[x] = now
    for i, t in ref.items():
        assert finish[i] == pytest.approx(t, abs=0.01)


def test_rate_is_one_at_reference_load_and_faster_below() -> None:
    model = EngineModel.for_size(4, 144, generation_share=0.6, half_per_node=36.0)
    assert model.rate(144) == pytest.approx(1.0)
    assert model.rate(1) > 1.2


def test_one_cost_model_per_engine_size() -> None:
    """An idle 8-node, 288-slot engine speeds a lone execution up as much as an idle 4-node,
    144-slot one (it used to be 2.19x against 1.59x with one curve for every size)."""
    small = EngineModel.for_size(4, 144, generation_share=0.6, half_per_node=36.0)
    large = EngineModel.for_size(8, 288, generation_share=0.6, half_per_node=36.0)
    assert large.rate(1) == pytest.approx(small.rate(1), rel=0.01)
    assert large.rate(144) == pytest.approx(small.rate(72), rel=0.01)  # same load per node
    assert 1.5 < small.rate(1) < 1.7


def test_template_is_calibrated_to_paper_figures() -> None:
    """NL2RepoBench (§6.2): 1.93 h per execution, 2.96 h per query, 9.51 % of queries >= 4 h,
    6.25 % harness and 0.87 % overall timeouts (at the reference load)."""
    cfg = load_sim_config(TEMPLATE)
    stats = nominal_stats(cfg.workload, cfg.scheduler.group_size, groups=3000, seed=1)
    assert stats["mean_execution_h"] == pytest.approx(1.93, abs=0.1)
    assert stats["mean_query_h"] == pytest.approx(2.96, abs=0.2)
    assert stats["queries_over_4h"] == pytest.approx(0.0951, abs=0.02)
    assert stats["harness_timeouts"] == pytest.approx(0.0625, abs=0.01)
    assert stats["overall_timeouts"] == pytest.approx(0.0087, abs=0.004)
