"""Core retention (paper §4.2): when the next batch is ready as the core publishes, the core
keeps training — it begins the next burst without a round trip to rollout."""

from __future__ import annotations

from gyre.schedule import Config, PolicyConfig, Scheduler, events, make_policy
from gyre.vocabulary import Outcome, Role


def _scheduler() -> Scheduler:
    config = Config(nodes=3, cells=3, train_layout_nodes=1, concurrency_per_cell=4,
                    group_size=2, batch_groups=2, phi=1.0, mu=1, supply_fraction=0.5,
                    join_min_microsteps=0)  # fmt: skip
    return Scheduler(config, make_policy(config, PolicyConfig(name="elastic")))


def _serve(s: Scheduler, out: list, log: list, publish: bool = True) -> None:
    """Answer every cell-side action the way a cell does, until nothing is left to answer
    (a publication only with `publish`: it is still on the wire otherwise)."""
    while out:
        a, out = out[0], out[1:]
        log.append(a)
        if isinstance(a, events.SwitchCell):
            out += s.handle(events.SwitchDone(a.cell))
        elif isinstance(a, events.AdmitGroup):
            out += s.handle(events.MicroStepsQueued(batch=a.batch, group=a.group, count=1))
        elif isinstance(a, events.ClaimMicroStep):
            out += s.handle(events.MicroStepDone(cell=a.cell, batch=a.batch))
            if a.work is events.Work.PREPASS:
                out += s.handle(events.GradientsReady(batch=a.batch, count=1))
        elif isinstance(a, events.OptimizerUpdate):
            out += s.handle(events.BatchDone(a.batch))
        elif isinstance(a, events.Publish) and publish:
            out += s.handle(events.WeightsPublished(a.version))


def _finish_groups(s: Scheduler, groups: range, log: list) -> None:
    for g in groups:
        for x in (2 * g, 2 * g + 1):  # group_size 2: executions 2g, 2g + 1
            _serve(s, s.handle(events.Terminated(x, Outcome.COMPLETED)), log, publish=False)
        _serve(s, s.handle(events.GroupReady(g)), log, publish=False)


def _published(s: Scheduler, log: list) -> list:
    """The first publication arrives: the scheduler's answer to it."""
    publish = next(a for a in log if isinstance(a, events.Publish))
    return s.handle(events.WeightsPublished(publish.version))


def test_the_core_keeps_training_when_the_next_batch_is_ready_at_publication() -> None:
    s, log = _scheduler(), []
    _serve(s, s.handle(events.Start()), log)  # (phi + mu) B = 4 groups dispatched
    _finish_groups(s, range(4), log)  # batch 0 trains; groups 2, 3 ready before it publishes
    assert s.version == 1 and s.roles[0] is Role.TRAIN
    after = _published(s, log)
    core_moves = [a.role for a in after if isinstance(a, events.SwitchCell) and a.cell == 0]
    assert core_moves == [], after  # no trip to rollout between the bursts
    assert [a.batch for a in after if isinstance(a, events.OpenJoinWindow)][:1] == [1]
    assert {a.group for a in after if isinstance(a, events.AdmitGroup)} == {2, 3}


def test_without_ready_data_the_core_returns_to_rollout() -> None:
    s, log = _scheduler(), []
    _serve(s, s.handle(events.Start()), log)
    _finish_groups(s, range(2), log)  # only batch 0: nothing ready when it publishes
    after = _published(s, log)
    assert events.SwitchCell(cell=0, role=Role.ROLLOUT) in after
