"""The simulator's reported counters against a slow recount from its own message log.

A test wraps the scheduler of a real `Simulator` so that every event it is fed and every
action it answers is logged with the simulated time. After the run each figure of the
`SimResult` (and the scheduler's counters d, p, f) is recounted from that log alone: launches,
terminations, dispatches, reroutes, cell switches, wasted satellite switches, staleness,
harness timeouts, step ends and the time every cell spent outside rollout. Configurations are
tiny and random, so a counter that drifts from what really happened shows up in seconds.

Oversampling is drawn too (k extra executions per group, with an overall budget short
enough to exclude some executions): every admitted group's members are recomputed from the
simulator's own records (when each execution ended, when its outcome settled, whether it
was valid) — the first N to settle valid, filled up with the first excluded — and each
complete group's N + k executions are launched or withdrawn, never both.

The switch count and the timeline are checked apart: a satellite whose switch to training
ends after its burst was once recorded as "to_rollout" twice (and counted as two switches);
`LATE_SATELLITES` reproduces that case.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyre.schedule import events as ev
from gyre.sim import SimConfig, SimResult, Simulator, load_sim_config
from gyre.sim.config import PolicySpec
from gyre.sim.workload import HOUR
from gyre.vocabulary import Outcome, Role

from .paths import TEMPLATE

BASE = load_sim_config(TEMPLATE)
Log = list[tuple[float, ev.Event, list[ev.Action]]]


def sim_config(
    *,
    cells: int,
    standalone: int,
    steps: int,
    seed: int,
    microstep_tokens: float,
    switch_to_train_s: float,
    overall_timeout_h: float = BASE.workload.overall_timeout_h,
    **scheduler: Any,
) -> SimConfig:
    """The NL2RepoBench template on `cells` one-node cells, more hard queries (harness
    timeouts), one cell fixed in training for Async; `scheduler` holds scheduler knobs."""
    costs = dataclasses.replace(
        BASE.costs, microstep_tokens=microstep_tokens, switch_to_train_s=switch_to_train_s
    )
    sched = dataclasses.replace(
        BASE.scheduler,
        nodes=cells,
        cells=cells,
        train_layout_nodes=1,
        standalone_nodes=standalone,
        **scheduler,
    )
    return dataclasses.replace(
        BASE,
        steps=steps,
        seed=seed,
        staleness=None,
        scheduler=sched,
        costs=costs,
        workload=dataclasses.replace(
            BASE.workload, hard_query_prob=0.3, overall_timeout_h=overall_timeout_h
        ),
        policies={"async": PolicySpec(train_cells=1, streaming=False)},
    )


@st.composite
def setups(draw: st.DrawFn) -> tuple[SimConfig, str]:
    """A few cells of one node each, small N and B, one to three steps."""
    cells = draw(st.integers(1, 4))
    standalone = draw(st.integers(0, 2))
    policy = draw(st.sampled_from(["elastic", "async", "colocate"]))
    if policy == "async" and cells == 1 and standalone == 0:
        standalone = 1
    config = sim_config(
        cells=cells,
        standalone=standalone,
        switch_to_train_s=draw(st.sampled_from([8.52, 600.0, 3600.0])),  # late joins too
        concurrency_per_cell=draw(st.integers(1, 6)),
        group_size=draw(st.integers(1, 4)),
        oversample=draw(st.sampled_from([0, 0, 1, 2])),
        # 4.05 h: a timed-out execution whose scoring takes two attempts is excluded
        overall_timeout_h=draw(st.sampled_from([4.5, 4.05])),
        batch_groups=draw(st.integers(1, 4)),
        phi=draw(st.sampled_from([0.0, 0.5, 1.0])),
        mu=draw(st.integers(1, 2)),
        join_min_microsteps=draw(st.integers(0, 3)),
        join_payback=draw(st.sampled_from([0.0, 1.0])),
        microstep_tokens=draw(st.sampled_from([0.0, 50_000.0, 400_000.0])),
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )
    return config, policy


# an hour-long switch to training: satellites 1 and 2 arrive after the burst they joined for
LATE_SATELLITES = sim_config(
    cells=4,
    standalone=0,
    switch_to_train_s=3600.0,
    concurrency_per_cell=4,
    group_size=2,
    batch_groups=4,
    phi=0.0,
    mu=2,
    join_min_microsteps=0,
    join_payback=0.0,
    microstep_tokens=0.0,
    steps=3,
    seed=2,
)


def logged(sim: Simulator) -> Log:
    """Log every (time, event, actions) the simulator's scheduler handles from now on."""
    log: Log = []
    handle = sim.scheduler.handle

    def handle_and_log(event: ev.Event) -> list[ev.Action]:
        actions = handle(event)
        log.append((sim.now, event, list(actions)))
        return actions

    sim.scheduler.handle = handle_and_log  # type: ignore[method-assign]
    return log


def of(log: Log, kind: type) -> list[tuple[float, Any]]:
    """(time, message) of every event or action of one kind, in order."""
    out: list[tuple[float, Any]] = []
    for t, event, actions in log:
        out += [(t, m) for m in [event, *actions] if isinstance(m, kind)]
    return out


def wasted_recount(log: Log, satellites: set[int]) -> int:
    """Satellite switches back to rollout with no pass claimed since the switch to training."""
    worked: dict[int, bool] = {}
    wasted = 0
    for _, action in of(log, ev.Action):
        if isinstance(action, ev.ClaimMicroStep):
            worked[action.cell] = True
        elif isinstance(action, ev.SwitchCell) and action.cell in satellites:
            if action.role is Role.TRAIN:
                worked[action.cell] = False
            elif not worked.get(action.cell, True):
                wasted += 1
    return wasted


def away_recount(log: Log, first_roles: list[str], end: float) -> list[float]:
    """Seconds each cell spent outside rollout in [0, end]: from a SwitchCell(TRAIN) action
    to the SwitchDone that returns it to rollout."""
    away_since = [0.0 if role != "rollout" else None for role in first_roles]
    spent = [0.0] * len(first_roles)
    to_rollout: set[int] = set()
    for t, event, actions in log:
        if isinstance(event, ev.SwitchDone) and event.cell in to_rollout:
            to_rollout.discard(event.cell)
            since = away_since[event.cell]
            assert since is not None
            spent[event.cell] += min(t, end) - min(since, end)
            away_since[event.cell] = None
        for a in actions:
            if isinstance(a, ev.SwitchCell) and a.role is Role.TRAIN:
                away_since[a.cell] = t
            elif isinstance(a, ev.SwitchCell):
                to_rollout.add(a.cell)
    for c, since in enumerate(away_since):
        if since is not None:
            spent[c] += end - min(since, end)
    return spent


def settle_order(sim: Simulator, xs: range) -> list[tuple[int, bool]]:
    """(execution, valid) of the group's ended executions in the order their outcomes settled,
    from the simulator's records: a valid one once scored, an excluded one when its overall
    budget ran out (ties: the one that ended first, then the lower id)."""
    budget = sim.config.workload.overall_timeout_h * HOUR
    keys = []
    for x in xs:
        end = sim.end_t[x]
        if end >= 0:
            settled = end + (min(end + sim.eval_s[x], sim.launch_t[x] + budget) - end)
            keys.append((settled, end, x))
    return [(x, sim.valid[x]) for _, _, x in sorted(keys)]


def members_recount(sim: Simulator, log: Log, launched: set[int], withdrawn: set[int]) -> None:
    """Every admitted group trains the N the rule picks from the simulator's records; a
    complete group's N + k executions were each launched or withdrawn."""
    sc = sim.sched_config
    n, size = sc.group_size, sc.executions_per_group
    for _, a in of(log, ev.AdmitGroup):
        xs = range(a.group * size, (a.group + 1) * size)
        order, valid, upto = settle_order(sim, xs), 0, None
        for i, (_, ok) in enumerate(order):
            valid += ok
            if valid == n or i + 1 == size:
                upto = i + 1
                break
        assert upto is not None, f"group {a.group} admitted before it was complete"
        chosen = [x for x, ok in order[:upto] if ok][:n]
        chosen += [x for x, ok in order[:upto] if not ok][: n - len(chosen)]
        assert a.members == tuple(sorted(chosen)), (a, order)
        assert all(sim.valid[x] for x in a.members) or len(order) == size
        assert all((x in launched) != (x in withdrawn) for x in xs)
        assert sum(x in launched for x in xs) == size - sum(x in withdrawn for x in xs)
        if sim.config.costs.microstep_tokens <= 0:  # a micro-step per valid member
            queued = [e for _, e in of(log, ev.MicroStepsQueued) if e.group == a.group]
            assert queued[0].count == sum(sim.valid[x] for x in a.members)


def run_logged(config: SimConfig, policy: str) -> tuple[Simulator, SimResult, Log]:
    sim = Simulator(config, policy)
    log = logged(sim)
    return sim, sim.run(), log


@settings(max_examples=25, deadline=None)
@given(setup=setups())
def test_reported_counters_equal_a_recount_of_the_message_log(
    setup: tuple[SimConfig, str],
) -> None:
    """executions, reroutes, wasted switches, staleness, harness timeouts, step ends and
    training shares are what the scheduler's events and actions say happened."""
    config, policy = setup
    first_roles = [r.value for r in Simulator(config, policy).scheduler.roles]
    sim, result, log = run_logged(config, policy)
    s = sim.scheduler

    launched = [a.execution for _, a in of(log, ev.Launch)]
    withdrawn = [a.execution for _, a in of(log, ev.Withdraw)]
    terminated = [e for _, e in of(log, ev.Terminated)]
    dispatched = [x for _, a in of(log, ev.Dispatch) for x in a.executions]
    assert len(set(launched)) == len(launched) == result.executions == s.p - s.withdrawn
    assert len(set(withdrawn)) == len(withdrawn) == result.withdrawn == s.withdrawn
    assert not set(withdrawn) & set(launched)
    assert len({e.execution for e in terminated}) == len(terminated) == s.f - s.withdrawn
    assert {e.execution for e in terminated} <= set(launched)
    assert len(dispatched) == s.d == s.p + len(s.queue) == len(sim.nominal)
    assert sum(1 for t in sim.end_t if t >= 0) == len(terminated)
    cancelled = {a.execution for _, a in of(log, ev.Cancel)}
    assert result.cancelled == sum(e.outcome is Outcome.CANCELLED for e in terminated)
    assert cancelled >= {e.execution for e in terminated if e.outcome is Outcome.CANCELLED}
    members_recount(sim, log, set(launched), set(withdrawn))

    assert result.reroutes == len(of(log, ev.Reroute))
    assert result.wasted_switches == wasted_recount(log, set(s.satellites))
    staleness = [a.staleness for _, a in of(log, ev.AdmitGroup)]
    assert result.mean_staleness == pytest.approx(statistics.fmean(staleness))
    outcomes = Counter(e.outcome for e in terminated)
    assert result.workload["harness_timeouts"] == pytest.approx(
        outcomes[Outcome.TIMED_OUT] / len(terminated)
    )

    ends = [t for t, _ in of(log, ev.BatchDone)][: config.steps]
    assert result.step_end_h == pytest.approx([t / HOUR for t in ends])
    total = ends[-1]
    assert result.total_h == pytest.approx(total / HOUR)
    away = away_recount(log, first_roles, total)
    assert [share * total for share in result.train_share] == pytest.approx(away, abs=1e-6)


def switch_entries(log: Log) -> Counter[tuple[float, int, str]]:
    """The timeline the switch messages imply: (t, cell, "to_train" | "to_rollout") per
    SwitchCell, (t, cell, "train" | "rollout") per SwitchDone."""
    entries: Counter[tuple[float, int, str]] = Counter()
    going: dict[int, str] = {}
    for t, event, actions in log:
        if isinstance(event, ev.SwitchDone):
            entries[(t, event.cell, going.pop(event.cell))] += 1
        for a in actions:
            if isinstance(a, ev.SwitchCell):
                going[a.cell] = a.role.value
                entries[(t, a.cell, f"to_{a.role.value}")] += 1
    return entries


@settings(max_examples=25, deadline=None)
@example(setup=(LATE_SATELLITES, "elastic"))
@given(setup=setups())
def test_switch_count_and_timeline_follow_the_switch_messages(
    setup: tuple[SimConfig, str],
) -> None:
    """`switches` is the number of SwitchCell actions; the timeline holds each cell's first
    role at 0, then one entry per SwitchCell and per SwitchDone, at its time."""
    config, policy = setup
    _, result, log = run_logged(config, policy)
    cells = config.scheduler.cells
    assert result.switches == len(of(log, ev.SwitchCell))
    first = [(0.0, c, r.value) for c, r in enumerate(Simulator(config, policy).scheduler.roles)]
    assert result.timeline[:cells] == first
    assert Counter(result.timeline[cells:]) == switch_entries(log)
