"""Scenario tests of the scheduler: launch limits, waterlevel, reroute order, policies."""

from __future__ import annotations

from typing import Any

import pytest

from gyre.errors import SchedulerError
from gyre.schedule import Config, PolicyConfig, Scheduler, events, make_policy
from gyre.schedule.events import Role


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
        s.handle(events.Terminated(0, events.Outcome.COMPLETED))
    s.handle(events.Start())
    s.handle(events.Terminated(0, events.Outcome.FAILED))
    with pytest.raises(SchedulerError, match="not running"):
        s.handle(events.Terminated(0, events.Outcome.COMPLETED))
    with pytest.raises(SchedulerError, match="still has running"):
        s.handle(events.GroupReady(1))


def test_core_leaves_first_when_remaining_capacity_serves_waterlevel() -> None:
    s = make()
    s.handle(events.Start())  # 6 executions on 3 engines x 4 slots
    out = s.handle(events.Terminated(0, events.Outcome.COMPLETED))
    assert not of(out, events.SwitchCell)  # not enough supply yet: group 0 not ready
    out = s.handle(events.Terminated(1, events.Outcome.COMPLETED))
    out += s.handle(events.GroupReady(0))
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
        out += s.handle(events.Terminated(x, events.Outcome.COMPLETED))
    assert events.SwitchCell(cell=0, role=Role.TRAIN) in out
    order = [r.destination for r in of(out, events.Reroute)]
    assert order == sorted(order, key=lambda e: (e != 3, -e))  # standalone (3) first


def test_colocate_switches_whole_pool_only_when_outstanding_fits_standalone() -> None:
    s = make("colocate", streaming=False, phi=0.0, standalone_nodes=0)
    s.handle(events.Start())  # 2 groups x 2 executions
    s.handle(events.Terminated(0, events.Outcome.COMPLETED))
    s.handle(events.Terminated(1, events.Outcome.COMPLETED))
    out = s.handle(events.GroupReady(0))
    assert not of(out, events.SwitchCell)  # W = 2 > 0: the tail still runs
    s.handle(events.Terminated(2, events.Outcome.HARNESS_TIMEOUT))
    out = s.handle(events.Terminated(3, events.Outcome.COMPLETED))
    out += s.handle(events.GroupReady(1))
    assert sorted(a.cell for a in of(out, events.SwitchCell)) == [0, 1, 2]


def test_async_split_never_switches_and_trains_on_fixed_cells() -> None:
    s = make("async", streaming=False, train_cells=2, phi=0.0)
    assert s.roles == [Role.TRAIN, Role.TRAIN, Role.ROLLOUT]
    out = s.handle(events.Start())
    assert {a.engine for a in of(out, events.Launch)} == {2}
    for x in range(4):
        out = s.handle(events.Terminated(x, events.Outcome.COMPLETED))
        assert not of(out, events.SwitchCell)
    s.handle(events.GroupReady(0))
    out = s.handle(events.GroupReady(1))
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
        log += s.handle(events.Terminated(x, events.Outcome.COMPLETED))
    log += s.handle(events.GroupReady(0))
    assert of(log, events.SwitchCell) == [events.SwitchCell(cell=0, role=Role.TRAIN)]
    log += s.handle(events.SwitchDone(0))
    assert events.OpenJoinWindow(0) in log
    assert [a.group for a in of(log, events.AdmitGroup)] == [0]
    # W = 0 and work is left in the batch: satellites join, in cell order
    assert [j.cell for j in of(log, events.SwitchCell)] == [0, 1, 2]
    log += s.handle(events.MicroStepsQueued(batch=0, group=0, count=3))
    log += s.handle(events.SwitchDone(1))
    log += s.handle(events.GroupReady(1))
    log += s.handle(events.MicroStepsQueued(batch=0, group=1, count=1))
    assert {c.cell for c in of(log, events.ClaimMicroStep)} == {0, 1}  # cell 2 still switching
    while not s.batch.updating:  # type: ignore[union-attr]
        busy = [c for c in range(3) if s.busy[c]]
        log += s.handle(events.MicroStepDone(cell=busy[0], batch=0))
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
    s.handle(events.Terminated(0, events.Outcome.CANCELLED))
    assert s.f == 1 and s.p == 4  # the freed slot went to the next queued execution
    assert s.handle(events.Tick(12.5)) == []
