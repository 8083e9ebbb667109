"""The start of a run at the coordinator: every rank ready, then a resumed run's take-over
(docs/runtime.md "Start-up", "Crashes and resume").

    startup    -> wait for the proxy node and every engine (their start-up phases on the
                  way), tell the proxy the engines; cells the policy keeps in training
                  (Async) are drained and sent to train without a scheduler switch
    take_over  -> a resumed run (`resume`): close what the dead job left open, rescore what
                  was running from its preserved workspace, carry the untrained groups worth
                  training into the scheduler

Then the scheduler starts (`ev.Start(carried=...)`). Functions of the coordinator's state
(`CoordinatorState`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gyre.runtime.coordinator.inbox import REPORTS
from gyre.runtime.coordinator.state import CoordinatorState
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import wire
from gyre.runtime.shared.layout import PROXY_RANK
from gyre.vocabulary import EngineId, Role


def startup(c: CoordinatorState) -> None:
    """Wait for the proxy, every engine and every judge engine; tell the proxy the engines
    and the judges."""
    needed = {"proxy"} | {f"engine{e}" for e in range(len(c.ranks.engines))}
    needed |= {f"judge{j}" for j in range(len(c.ranks.judges))}
    judges: dict[int, str] = {}
    while needed:
        m = c.inbox.next(c.cfg.timeouts.startup_s)
        if isinstance(m, msg.StartupTimes):
            c.profile.add(m.rank, m.component, m.phases)
        elif isinstance(m, msg.ProxyReady):
            needed.discard("proxy")
            c.profile.arrived(PROXY_RANK, "proxy start")
            c.proxy_url, c.task_names = m.url, list(m.tasks)
        elif isinstance(m, msg.EngineReady):
            needed.discard(f"engine{m.engine}")
            c.fleet.ready(m.engine, m.url)
        elif isinstance(m, msg.JudgeReady):  # never in the fleet: never published to
            needed.discard(f"judge{m.judge}")
            judges[m.judge] = m.url
            c.rec.event("judge_ready", judge=m.judge, url=m.url)
        else:
            raise wire.RuntimeFailure(f"unexpected message at startup: {m!r:.200}")
    c.to_proxy(msg.SetEngines(c.fleet.urls()))
    c.judges = [judges[j] for j in sorted(judges)]
    if c.judges:
        c.to_proxy(msg.SetJudges(c.judges))
    for cell, role in enumerate(c.sched.roles):  # Async: cells fixed in training
        if role is Role.TRAIN:
            c.fleet.fix_in_training(cell)  # not a scheduler switch: no SwitchDone
            for e in c.fleet.of_cell(cell):
                c.to_proxy(msg.Drain(str(EngineId(e)), {}, ack=False))
            c.to_cell(cell, msg.ToTrain())
    c.rec.set_roles(list(c.sched.roles))
    c.rec.event("started", seconds=time.time() - c.t0, proxy=c.proxy_url)
    c.profile.clock.mark("ranks ready")


def take_over(c: CoordinatorState) -> tuple[int, ...]:
    """A resumed run: close what the dead job left open, carry its untrained groups
    (`resume`); returns the dispatch versions of the groups that enter the scheduler ready.
    """
    if c.resume.takeover is None:
        return ()
    t0 = time.time()
    c.resume.reopen(c.ledger, c.rec, c.to_proxy)
    recovering = c.resume.recovering

    def one_more_scored(left: int) -> Callable[[], bool]:
        return lambda: len(recovering) < left

    while recovering:  # each rescored execution within timeouts.drain_s
        c.inbox.drain_until(one_more_scored(len(recovering)), REPORTS, c.cfg.timeouts.drain_s,
                            awaited=msg.Assessed)  # fmt: skip
    carried, dropped = c.resume.carry(c.ledger)
    c.rec.event("resumed", version=c.sched.version, updates=c.updates,
                carried=[g.id for g in carried], dropped=dropped,
                repaired=c.rec.writer.repaired, seconds=time.time() - t0)  # fmt: skip
    return tuple(g.version for g in carried)
