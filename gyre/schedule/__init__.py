"""Gyre's scheduler: a pure state machine for Elastic, Async and Colocate placement.

    from gyre.schedule import Scheduler, Config, PolicyConfig, make_policy, events
    sched = Scheduler(cfg, make_policy(cfg, PolicyConfig(name="elastic")))
    actions = sched.handle(events.Start())

A driver (the coordinator, the simulator) hands it events through one `Feed`, which carries
out each action by its type (`gyre.schedule.feed`). See docs/scheduler.md for the equations
and the event/action protocol.
"""

from gyre.schedule import events
from gyre.schedule.config import Config, PolicyConfig
from gyre.schedule.feed import Feed
from gyre.schedule.machine import Phase, Scheduler
from gyre.schedule.plan import Plan, expected_staleness, plan, plan_for
from gyre.schedule.policy import Policy, asynchronous, colocate, elastic, make_policy

__all__ = [
    "Config",
    "Feed",
    "Phase",
    "Plan",
    "Policy",
    "PolicyConfig",
    "Scheduler",
    "asynchronous",
    "colocate",
    "elastic",
    "events",
    "expected_staleness",
    "make_policy",
    "plan",
    "plan_for",
]
