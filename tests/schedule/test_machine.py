"""Scenario tests of the scheduler: launch limits, waterlevel, reroute order, policies."""

from __future__ import annotations

from typing import Any

import pytest

from gyre.errors import SchedulerError
from gyre.schedule import Config, PolicyConfig, Scheduler, events, make_policy
from gyre.vocabulary import Outcome, Role


def make(name: Any = "elastic", streaming: bool = True, **kw: object) -> Scheduler:
    args: dict = dict(
        nodes=3, cells=3, train_layout_nodes=1, concurrency_per_cell=4, group_size=2,
        batch_groups=2, phi=0.5, mu=1, supply_fraction=0.5, join_min_microsteps=0,
    )  # fmt: skip
    train_cells = int(kw.pop("train_cells", 1))  # type: ignore[call-overload]
    args.update(kw)
    config = Config(**args)
    policy = make_policy(
        config, PolicyConfig(name=name, streaming=streaming, train_cells=train_cells)
    )
    return Scheduler(config, policy)


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def ready(s: Scheduler, g: int) -> list:
    """Settle every execution of group g valid (as a driver's evaluator would)."""
    out: list = []
    for x in s.groups.executions(g):
        out += s.handle(events.Assessed(x, valid=True))
    return out


def test_start_fills_queue_and_launches_within_limits() -> None:
    s = make(concurrency_per_cell=1)
    out = s.handle(events.Start())
    dispatches = of(out, events.Dispatch)
    assert len(dispatches) == 3  # (φ + μ) B = (0.5 + 1) * 2
    assert all(d.version == 0 and len(d.executions) == 2 for d in dispatches)
    launches = of(out, events.Launch)
    assert len(launches) == 3  # three engines of concurrency 1
    assert sorted(a.engine for a in launches) == [0, 1, 2]
    assert (s.d, s.p, s.f) == (6, 3, 0)
    assert s.waterlevel == 6


def test_terminated_twice_or_unknown_is_rejected() -> None:
    s = make()
    with pytest.raises(SchedulerError, match="before Start"):
        s.handle(events.Terminated(0, Outcome.COMPLETED))
    s.handle(events.Start())
    s.handle(events.Terminated(0, Outcome.FAILED))
    with pytest.raises(SchedulerError, match="not running"):
        s.handle(events.Terminated(0, Outcome.COMPLETED))
    with pytest.raises(SchedulerError, match="execution 2 is not terminated"):
        s.handle(events.Assessed(2, valid=True))
    s.handle(events.Assessed(0, valid=False))
    with pytest.raises(SchedulerError, match="execution 0 is not terminated and unsettled"):
        s.handle(events.Assessed(0, valid=True))  # an outcome settles once


def test_core_leaves_first_when_remaining_capacity_serves_waterlevel() -> None:
    s = make()
    s.handle(events.Start())  # 6 executions on 3 engines x 4 slots
    out = s.handle(events.Terminated(0, Outcome.COMPLETED))
    assert not of(out, events.SwitchCell)  # not enough supply yet: group 0 not ready
    out = s.handle(events.Terminated(1, Outcome.COMPLETED))
    out += ready(s, 0)
    switches = of(out, events.SwitchCell)
    assert switches == [events.SwitchCell(cell=0, role=Role.TRAIN)]  # W = 4 <= 12 - 4
    # the core's executions moved to cells in descending order, the core accepts nothing
    reroutes = of(out, events.Reroute)
    assert all(r.source == 0 and r.destination in (1, 2) for r in reroutes)
    assert not s.engines[0].running
    assert s.roles[0] is Role.TO_TRAIN


def test_reroute_prefers_standalone_then_descending_cells() -> None:
    s = make(concurrency_per_cell=2, nodes=3, cells=3, standalone_nodes=1, group_size=4, phi=0.0)
    s.handle(events.Start())  # 8 executions on 4 engines x 2
    out = []
    for x in (0, 1, 2, 3):  # group 0 all terminated: soon-ready supply passes
        out += s.handle(events.Terminated(x, Outcome.COMPLETED))
    assert events.SwitchCell(cell=0, role=Role.TRAIN) in out
    order = [r.destination for r in of(out, events.Reroute)]
    assert order == sorted(order, key=lambda e: (e != 3, -e))  # standalone (3) first


def test_colocate_switches_whole_pool_only_when_outstanding_fits_standalone() -> None:
    s = make("colocate", streaming=False, phi=0.0, standalone_nodes=0)
    s.handle(events.Start())  # 2 groups x 2 executions
    s.handle(events.Terminated(0, Outcome.COMPLETED))
    s.handle(events.Terminated(1, Outcome.COMPLETED))
    out = ready(s, 0)
    assert not of(out, events.SwitchCell)  # W = 2 > 0: the tail still runs
    s.handle(events.Terminated(2, Outcome.TIMED_OUT))
    out = s.handle(events.Terminated(3, Outcome.COMPLETED))
    out += ready(s, 1)
    assert sorted(a.cell for a in of(out, events.SwitchCell)) == [0, 1, 2]


def test_async_split_never_switches_and_trains_on_fixed_cells() -> None:
    s = make("async", streaming=False, train_cells=2, phi=0.0)
    assert s.roles == [Role.TRAIN, Role.TRAIN, Role.ROLLOUT]
    out = s.handle(events.Start())
    assert {a.engine for a in of(out, events.Launch)} == {2}
    for x in range(4):
        out = s.handle(events.Terminated(x, Outcome.COMPLETED))
        assert not of(out, events.SwitchCell)
    ready(s, 0)
    out = ready(s, 1)
    admitted = of(out, events.AdmitGroup)
    assert [a.staleness for a in admitted] == [0, 0]
    out = []
    for a in admitted:
        out += s.handle(events.MicroStepsQueued(batch=0, group=a.group, count=2))
    claims = of(out, events.ClaimMicroStep)
    assert sorted(c.cell for c in claims) == [0, 1]


def test_burst_cycle_join_window_update_publish_and_dispatch() -> None:
    s = make(mu=1, phi=0.0, join_min_microsteps=0)
    log = s.handle(events.Start())
    for x in range(4):
        log += s.handle(events.Terminated(x, Outcome.COMPLETED))
    log += ready(s, 0)
    assert of(log, events.SwitchCell) == [events.SwitchCell(cell=0, role=Role.TRAIN)]
    log += s.handle(events.SwitchDone(0))
    assert events.OpenJoinWindow(0) in log
    assert [a.group for a in of(log, events.AdmitGroup)] == [0]
    # satellites decide once the admitted group's micro-steps are counted (packed)
    assert [j.cell for j in of(log, events.SwitchCell)] == [0]
    log += s.handle(events.MicroStepsQueued(batch=0, group=0, count=3))
    # W = 0 and work is left in the batch: satellites join, in cell order
    assert [j.cell for j in of(log, events.SwitchCell)] == [0, 1, 2]
    log += s.handle(events.SwitchDone(1))
    log += ready(s, 1)
    log += s.handle(events.MicroStepsQueued(batch=0, group=1, count=1))
    assert {c.cell for c in of(log, events.ClaimMicroStep)} == {0, 1}  # cell 2 still switching
    claims = of(log, events.ClaimMicroStep)
    assert {c.work for c in claims} == {events.Work.PREPASS}  # nothing summed yet
    while not s.batch.updating:  # type: ignore[union-attr]
        c = next(c for c in range(3) if s.busy[c] is not None)
        work = s.busy[c]
        log += s.handle(events.MicroStepDone(cell=c, batch=0))
        if work is events.Work.PREPASS:  # its executions live in this micro-step only
            log += s.handle(events.GradientsReady(batch=0, count=1))
    grads = [a for a in of(log, events.ClaimMicroStep) if a.work is events.Work.GRADIENT]
    assert len(grads) == 4 and {a.cell for a in grads} <= {0, 1}  # the prefix only
    kinds = [type(a) for a in log]
    assert kinds.index(events.CloseJoinWindow) < kinds.index(events.OptimizerUpdate)
    assert of(log, events.OptimizerUpdate)[0].cells == (0, 1)
    out = s.handle(events.BatchDone(0))
    assert s.version == 1
    assert out == [events.SwitchCell(cell=1, role=Role.ROLLOUT)]  # satellites return first
    out = s.handle(events.SwitchDone(2))  # the late joiner goes straight back
    assert out == [events.SwitchCell(cell=2, role=Role.ROLLOUT)]
    assert not s.handle(events.SwitchDone(1))
    publish = of(s.handle(events.SwitchDone(2)), events.Publish)
    assert publish == [events.Publish(version=1, engines=(1, 2))]
    out = s.handle(events.WeightsPublished(1))
    dispatched = of(out, events.Dispatch)
    assert len(dispatched) == 2 and all(d.version == 1 for d in dispatched)
    # no ready data for the next burst: the core returns to rollout
    assert events.SwitchCell(cell=0, role=Role.ROLLOUT) in out


def test_gradient_passes_go_to_the_training_prefix_only() -> None:
    s = make(mu=1, phi=0.0, join_min_microsteps=0)
    log = s.handle(events.Start())
    for x in range(4):
        log += s.handle(events.Terminated(x, Outcome.COMPLETED))
    log += ready(s, 0) + s.handle(events.SwitchDone(0))
    log += s.handle(events.MicroStepsQueued(batch=0, group=0, count=2))
    log += s.handle(events.SwitchDone(2))  # cell 2 trains before cell 1: outside the prefix
    assert s.update_cells() == (0,)
    first = of(log, events.ClaimMicroStep)
    assert [(c.cell, c.work) for c in first] == [(0, events.Work.PREPASS), (2, events.Work.PREPASS)]
    out = s.handle(events.MicroStepDone(cell=2, batch=0))
    out += s.handle(events.GradientsReady(batch=0, count=1))
    assert not of(out, events.ClaimMicroStep)  # cell 2 may not take the gradient
    out = s.handle(events.MicroStepDone(cell=0, batch=0))
    assert of(out, events.ClaimMicroStep) == [
        events.ClaimMicroStep(cell=0, batch=0, work=events.Work.GRADIENT)
    ]
    with pytest.raises(SchedulerError, match="exceeds"):
        s.handle(events.GradientsReady(batch=0, count=5))


@pytest.mark.parametrize(("window", "claimed"), [("auto", 1), (6, 3), (2, 2)])
def test_a_pass_claims_a_window_of_what_is_queued(window: object, claimed: int) -> None:
    """The core's first pass takes the queued micro-steps, at most the window's: left at auto
    (a cell of one stage) one, as before windows; resolved for 3 stages (6) all three."""
    s = make(mu=1, phi=0.0, join_min_microsteps=0, window=window)
    log = s.handle(events.Start())
    for x in range(4):
        log += s.handle(events.Terminated(x, Outcome.COMPLETED))
    log += ready(s, 0) + s.handle(events.SwitchDone(0))
    log += s.handle(events.MicroStepsQueued(batch=0, group=0, count=3))
    assert [(c.cell, c.work, c.count) for c in of(log, events.ClaimMicroStep)] == [
        (0, events.Work.PREPASS, claimed)
    ]


def test_unknown_event_is_rejected() -> None:
    s = make()
    with pytest.raises(SchedulerError, match="unknown event"):
        s.handle("nonsense")  # type: ignore[arg-type]


def test_launched_confirms_running_executions_and_tick_reevaluates() -> None:
    s = make(concurrency_per_cell=1)
    s.handle(events.Start())
    assert s.handle(events.Launched(0)) == []
    with pytest.raises(SchedulerError, match="not running"):
        s.handle(events.Launched(5))  # still queued
    s.handle(events.Terminated(0, Outcome.CANCELLED))
    assert s.f == 1 and s.p == 4  # the freed slot went to the next queued execution
    assert s.handle(events.Tick(12.5)) == []


def test_a_resumed_start_brings_its_ready_groups_and_fills_the_rest_of_the_queue() -> None:
    s = make(mu=1, phi=0.0)  # queue depth (φ+μ)B = 2 groups
    out = s.handle(events.Start(carried=(3,)))
    assert [d.group for d in of(out, events.Dispatch)] == [1]  # one slot left for new work
    assert [s.groups[g].version for g in (0, 1)] == [3, s.published] and s.ready == [(3, 0)]
    assert (s.d, s.p, s.f) == (4, 4, 2) and s.waterlevel == 2  # carried executions are closed
    with pytest.raises(SchedulerError, match="twice"):
        s.handle(events.Start())


def _one_group_packed(s: Scheduler, core_switch_s: float, count: int = 3) -> list:
    """Start, finish both groups' executions, group 0 ready, core in TRAIN, group 0 packed
    into `count` micro-steps (group 1, soon ready, is expected to bring as many)."""
    log = s.handle(events.Start())
    for x in range(4):
        log += s.handle(events.Terminated(x, Outcome.COMPLETED))
    log += ready(s, 0)
    log += s.handle(events.SwitchDone(0, seconds=core_switch_s))
    log += s.handle(events.MicroStepsQueued(batch=0, group=0, count=count))
    return log


def test_satellites_join_only_when_the_work_left_pays_for_their_switches() -> None:
    """6 micro-steps to come: 6 prepasses x 5 s + 6 gradient passes x 15 s (the priors)."""
    cheap = make(mu=1, phi=0.0, join_min_microsteps=0)
    log = _one_group_packed(cheap, core_switch_s=1.0)  # satellites expect 1 s in, 3.46 s out
    assert [a.cell for a in of(log, events.SwitchCell)] == [0, 1, 2]
    # 120 - 60 = 60 s left on arrival, shared by 2 cells: less than a 63.46 s round trip
    dear = make(mu=1, phi=0.0, join_min_microsteps=0)
    log = _one_group_packed(dear, core_switch_s=60.0)
    assert [a.cell for a in of(log, events.SwitchCell)] == [0]
    # 2 micro-steps: the core starts one now and the other 20 s later, before a satellite
    # could (1 + 1/20 of them started by its arrival): nothing would be left for it
    serial = make(mu=1, phi=0.0, join_min_microsteps=0)
    log = _one_group_packed(serial, core_switch_s=1.0, count=1)
    assert [a.cell for a in of(log, events.SwitchCell)] == [0]
    # the paper's rule alone (payback 0) sends them anyway
    blind = make(mu=1, phi=0.0, join_min_microsteps=0, join_payback=0.0)
    log = _one_group_packed(blind, core_switch_s=60.0, count=1)
    assert [a.cell for a in of(log, events.SwitchCell)] == [0, 1, 2]


def test_estimates_start_at_the_prior_then_follow_measurements() -> None:
    s = make(cost_smoothing=0.5)
    est = s.costs
    assert est.switch_s(1, Role.TRAIN) == 8.52 and est.pass_s(events.Work.GRADIENT) == 15.0
    est.switched(0, Role.TRAIN, 2.0)  # the first measurement replaces the prior ...
    assert est.switch_s(0, Role.TRAIN) == 2.0
    assert est.switch_s(1, Role.TRAIN) == 2.0  # ... and stands in for cells not measured yet
    est.switched(1, Role.TRAIN, 4.0)
    assert est.switch_s(1, Role.TRAIN) == 4.0  # a cell's own measurement wins
    assert est.switch_s(2, Role.TRAIN) == 3.0  # pooled: 2, then halfway to 4
    assert est.switch_s(2, Role.ROLLOUT) == 3.46  # the other direction is separate
    est.passed(events.Work.PREPASS, 1.0)
    est.passed(events.Work.PREPASS, 3.0)
    assert est.pass_s(events.Work.PREPASS) == 2.0
    s.handle(events.Start())
    s.handle(events.Terminated(0, Outcome.COMPLETED))
    s.handle(events.Terminated(1, Outcome.COMPLETED))  # group 0 done: the core leaves
    with pytest.raises(SchedulerError, match="seconds"):
        s.handle(events.SwitchDone(0, seconds=float("nan")))
    assert s.roles[0] is Role.TO_TRAIN  # a refused event changes nothing


def test_a_satellite_that_arrives_after_its_burst_is_a_wasted_switch() -> None:
    s = make(mu=1, phi=0.0, join_min_microsteps=0)
    log = _one_group_packed(s, core_switch_s=1.0)  # cells 1 and 2 are on their way
    log += ready(s, 1)
    log += s.handle(events.MicroStepsQueued(batch=0, group=1, count=0))
    while not s.batch.updating:  # type: ignore[union-attr]  # the core does it all
        prepass = s.busy[0] is events.Work.PREPASS
        log += s.handle(events.MicroStepDone(cell=0, batch=0, seconds=0.5 if prepass else 1.5))
        if prepass:
            log += s.handle(events.GradientsReady(batch=0, count=1))
    assert of(log, events.OptimizerUpdate) and s.wasted_switches == 0
    s.handle(events.BatchDone(0))  # the burst is over before either satellite arrived
    assert s.handle(events.SwitchDone(1, seconds=1.0)) == [events.SwitchCell(1, Role.ROLLOUT)]
    assert s.wasted_switches == 1
    s.handle(events.SwitchDone(2, seconds=1.0))
    assert s.wasted_switches == 2
    assert s.costs.pass_s(events.Work.GRADIENT) == 1.5


def test_a_burst_without_streaming_waits_for_all_its_groups() -> None:
    """Colocate without streaming trains its μ steps back to back on completed groups."""
    s = make("colocate", streaming=False, phi=0.0, mu=2, standalone_nodes=1, nodes=2, cells=2)
    s.handle(events.Start())  # 4 groups of 2 on 3 engines x 4 slots
    log = []
    for x in range(6):
        log += s.handle(events.Terminated(x, Outcome.COMPLETED))
    for g in range(2):
        log += ready(s, g)
    assert not of(log, events.SwitchCell)  # B ready, W = 4 fits the standalone engine: not yet
    log += ready(s, 2)
    log += s.handle(events.Terminated(6, Outcome.COMPLETED))
    log += s.handle(events.Terminated(7, Outcome.COMPLETED))
    assert not of(log, events.SwitchCell)  # 3 of μB = 4 ready
    log += ready(s, 3)
    assert sorted(a.cell for a in of(log, events.SwitchCell)) == [0, 1]


def test_a_lost_engine_is_never_a_destination_until_it_is_restored() -> None:
    s = make(mu=1, phi=0.5, concurrency_per_cell=4)  # 3 cells x 4 slots, 3 groups of 2
    out = s.handle(events.Start())
    assert len(of(out, events.Launch)) == 6
    on2 = sorted(x for x, e in s.routing.route.items() if e == 2)
    out = s.handle(events.EngineLost(2))
    moved = of(out, events.Reroute)
    assert {m.execution for m in moved} == set(on2) and all(m.destination != 2 for m in moved)
    assert s.rollout_capacity == 8 and not s.engines[2].running
    # a role change now reroutes only to live engines: cell 1's work goes to cell 0
    for x in range(4):
        s.handle(events.Terminated(x, Outcome.COMPLETED))
    ready(s, 0)
    out = ready(s, 1)
    assert all(r.destination != 2 for r in of(out, events.Reroute))
    assert all(lu.engine != 2 for lu in of(out, events.Launch))
    s.handle(events.EngineRestored(2))
    assert s.engines[2].open and s.rollout_capacity >= 4
    with pytest.raises(SchedulerError, match="no engine 7"):
        s.handle(events.EngineLost(7))


def test_oversampling_replaces_an_excluded_execution() -> None:
    """N = 2 of 3: the first two to settle valid train; more than k excluded: filled up."""
    s = make(group_size=2, oversample=1, phi=0.0, batch_groups=1)
    out = s.handle(events.Start())
    assert of(out, events.Dispatch) == [events.Dispatch(group=0, executions=(0, 1, 2), version=0)]
    for x in (0, 1, 2):
        s.handle(events.Terminated(x, Outcome.COMPLETED))
    s.handle(events.Assessed(0, valid=False))  # excluded: the group needs both others
    assert s.soon_ready == 1 and s.handle(events.Assessed(1, valid=True)) == [] and not s.ready
    s.handle(events.Assessed(2, valid=True))
    assert s.ready == [(0, 0)] and s.groups[0].members == (1, 2)
    short = make(group_size=2, oversample=1, phi=0.0, batch_groups=1)
    short.handle(events.Start())
    for x, valid in ((0, False), (1, False), (2, True)):
        short.handle(events.Terminated(x, Outcome.COMPLETED))
        short.handle(events.Assessed(x, valid=valid))
    assert short.groups[0].members == (0, 2)  # one valid: filled up with the first excluded


def test_oversampling_cancels_the_running_surplus_and_withdraws_the_queued() -> None:
    s = make(nodes=1, cells=1, concurrency_per_cell=1, group_size=1, oversample=2, phi=0.0,
             batch_groups=1)  # fmt: skip
    assert of(s.handle(events.Start()), events.Launch) == [events.Launch(0, 0)]
    assert of(s.handle(events.Terminated(0, Outcome.COMPLETED)), events.Launch) == [
        events.Launch(1, 0)
    ]
    out = s.handle(events.Assessed(0, valid=True))  # N = 1 valid: the group is complete
    assert out[:2] == [events.Cancel(1), events.Withdraw(2)]
    assert (s.d, s.p, s.f, s.withdrawn, len(s.queue)) == (3, 3, 2, 1, 0)
    log = s.handle(events.Terminated(1, Outcome.CANCELLED))  # W = 0: the core may train
    log += s.handle(events.Assessed(1, valid=True))  # a surplus outcome settles late: no effect
    log += s.handle(events.SwitchDone(0))
    assert of(log, events.AdmitGroup) == [events.AdmitGroup(0, 0, 0, members=(0,))]
    with pytest.raises(SchedulerError, match=r"execution 2 is not terminated .*withdrawn"):
        s.handle(events.Assessed(2, valid=True))
