"""Property tests: counters, capacity, routing, oversampling and the staleness identity under
random orders.

Each setup draws the oversampling k (0 included: no oversampling) and the chance that an
outcome settles valid; the world (`driver.World`) checks the counters, the cancelled and
withdrawn surplus and every admitted group's members against `reference.GroupsReference`
after every event."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.schedule import Config, PolicyConfig, Scheduler, events, make_policy

from .driver import World


@st.composite
def setups(draw: st.DrawFn) -> tuple[Config, PolicyConfig, float]:
    cells = draw(st.integers(1, 4))
    standalone = draw(st.integers(0, 2))
    name: Any = draw(st.sampled_from(["elastic", "async", "colocate"]))
    if name == "async" and cells == 1 and standalone == 0:
        standalone = 1
    config = Config(
        nodes=cells,
        cells=cells,
        train_layout_nodes=1,
        concurrency_per_cell=draw(st.integers(1, 6)),
        standalone_nodes=standalone,
        group_size=draw(st.integers(1, 4)),
        oversample=draw(st.sampled_from([0, 0, 1, 2])),
        batch_groups=draw(st.integers(1, 4)),
        phi=draw(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0])),
        mu=draw(st.integers(1, 3)),
        supply_fraction=draw(st.sampled_from([0.25, 0.5, 1.0])),
        join_min_microsteps=draw(st.integers(0, 3)),
        join_payback=draw(st.sampled_from([0.0, 0.25, 1.0, 3.0])),
        window=draw(st.sampled_from([1, 1, 2, 4])),
        cost_smoothing=draw(st.sampled_from([0.25, 1.0])),
    )
    train_cells = draw(st.integers(1, max(1, cells - 1 if standalone == 0 else cells)))
    policy = PolicyConfig(name=name, streaming=draw(st.booleans()), train_cells=train_cells)
    valid_p = draw(st.sampled_from([1.0, 0.8, 0.5]))
    return config, policy, valid_p


def run_world(
    config: Config, policy: PolicyConfig, seed: int, bursts: int, valid_p: float = 1.0
) -> World:
    scheduler = Scheduler(config, make_policy(config, policy))
    world = World(scheduler, random.Random(seed), valid_p)
    world.feed(events.Start())
    while world.bursts_done < bursts:
        assert world.step(), f"stalled: {scheduler.phase}, W={scheduler.waterlevel}"
    return world


@settings(max_examples=120, deadline=None)
@given(setup=setups(), seed=st.integers(0, 2**32 - 1))
def test_invariants_and_exact_staleness_accounting(
    setup: tuple[Config, PolicyConfig, float], seed: int
) -> None:
    """0 <= f <= p <= d after every event, f counts each execution once, capacity holds,
    and Σ d over consumed groups = K B μ(μ-1)/2 + Σ v_d of the groups still unconsumed —
    with oversampling too: each group trains N members, valid ones whenever N settled valid."""
    config, policy, valid_p = setup
    world = run_world(config, policy, seed, bursts=4, valid_p=valid_p)
    b, mu = config.batch_groups, config.mu
    k, unconsumed_vd = world.snapshots[-1]
    consumed = world.staleness[: k * mu * b]
    assert sum(consumed) == k * b * mu * (mu - 1) // 2 + unconsumed_vd
    # every dispatch happened at a boundary: (φ+μ)B at start, μB after each publication
    dispatched = sum(isinstance(a, events.Dispatch) for a in world.log)
    assert dispatched == config.extra_groups + mu * b * (1 + world.publications)
    # N + k executions per group: each launched or withdrawn once, the rest still queued
    launched = sum(isinstance(a, events.Launch) for a in world.log)
    s = world.s
    assert s.d == dispatched * config.executions_per_group
    assert s.p == launched + s.withdrawn == launched + len(world.withdrawn)
    for a in world.log:
        if isinstance(a, events.AdmitGroup):
            assert len(a.members) == config.group_size
            assert set(a.members) <= set(s.groups.executions(a.group))
    if config.oversample == 0:
        assert not world.withdrawn and not world.cancelled


@settings(max_examples=12, deadline=None)
@given(setup=setups(), seed=st.integers(0, 2**32 - 1))
def test_long_run_mean_staleness_matches_identity(
    setup: tuple[Config, PolicyConfig, float], seed: int
) -> None:
    """Over a long run the measured mean staleness is φ + (μ-1)/2 (φ = ⌊φB⌉ / B)."""
    config, policy, valid_p = setup
    bursts = 60
    world = run_world(config, policy, seed, bursts=bursts, valid_p=valid_p)
    k, _ = world.snapshots[-1]
    consumed = world.staleness[: k * config.mu * config.batch_groups]
    phi = config.extra_groups / config.batch_groups
    expected = phi + (config.mu - 1) / 2
    mean = sum(consumed) / len(consumed)
    # unconsumed groups have v_d <= (K-1)μ, so the mean lies in [E[d] - φ, E[d]]
    assert expected - phi - 1e-9 <= mean <= expected + 1e-9
    # the start-up transient decays as 1/K (the last φB groups are still outstanding)
    assert abs(mean - expected) <= (2 * phi + config.mu) / bursts + 1e-9, (mean, expected)
