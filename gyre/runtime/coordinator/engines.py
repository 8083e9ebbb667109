"""The cells' engines at the coordinator: role switches, reroutes, losses and restarts
(docs/runtime.md "Role switches and harness-preserving reroute", "A killed engine"); what
it knows of each engine is the coordinator's `Fleet`.

The scheduler decides when a cell switches and where executions go; these handlers carry it
out between the proxy node and the cells:

    switch    -> to TRAIN: the fleet notes the switch; once the scheduler's reroutes of the
                 cell's executions are known, the proxy drains the engine (`drains`, after
                 every event) and acks -> `drained`: the cell gets ToTrain with the moved
                 executions' KV routes, aborts its calls and releases its engine; to ROLLOUT:
                 the cell resumes its engine (ToRollout)
    switched  -> the cell is in its new role: the whole transition's seconds are what the
                 scheduler learns from; back in rollout, the proxy routes to it again
    reroute   -> an execution continues on another engine
    lost      -> a killed engine is drained (its calls retry elsewhere) and restarted in the
                 cell's role; `engine_ready`: it serves again, reloaded if it missed a policy

Functions of the coordinator's state (`CoordinatorState`); the coordinator's `ACTIONS` and
`MESSAGES` tables name them.
"""

from __future__ import annotations

import time

from gyre.runtime.coordinator.state import CoordinatorState
from gyre.runtime.shared import messages as msg
from gyre.schedule import events as ev
from gyre.vocabulary import EngineId, Role


def switch(c: CoordinatorState, a: ev.SwitchCell) -> None:
    c.stats["switches"] += 1
    if a.role is Role.TRAIN:  # the Drain goes once the reroutes are known; Drained: ToTrain
        c.fleet.switch_to_train(a.cell, time.time())
    else:
        c.fleet.switch_to_rollout(a.cell, time.time())
        c.to_cell(a.cell, msg.ToRollout(c.sched.published))


def reroute(c: CoordinatorState, a: ev.Reroute) -> None:
    c.stats["reroutes"] += 1
    eid = c.ledger.executions[a.execution].id
    c.fleet.reroute(eid, a.source, a.destination)
    c.rec.event("reroute", execution=eid, source=a.source, destination=a.destination)


def drains(c: CoordinatorState) -> None:
    """The drains the fleet owes the proxy (a switch's, once its reroutes are known)."""
    for drain in c.fleet.drains():
        c.to_proxy(drain)


def drained(c: CoordinatorState, m: msg.Drained) -> None:
    """A cell's engine is drained; once all of them are, the cell switches (ToTrain)."""
    e = EngineId.parse(m.engine).index
    routes = c.fleet.drained(e)
    if routes is not None:
        c.to_cell(e // c.fleet.per_cell, msg.ToTrain(routes=routes))


def switched(c: CoordinatorState, m: msg.Switched) -> None:
    """The cell is in its new role; the whole transition (drain and reroute included, the
    time the cell served neither role) is what the scheduler learns from."""
    total = c.fleet.switched(m.cell, time.time())
    c.progress.switch_seconds.append(total)
    c.rec.event("switch", cell=m.cell, to=m.role.value, seconds=total, cell_seconds=m.seconds,
                **m.detail)  # fmt: skip
    if m.role is Role.ROLLOUT:
        for e in c.fleet.of_cell(m.cell):
            c.to_proxy(msg.Undrain(str(EngineId(e))))
    if c.fleet.leave_fixed(m.cell):
        return
    c.feed(ev.SwitchDone(m.cell, seconds=total))


def engine_lost(c: CoordinatorState, m: msg.EngineLost) -> None:
    """A killed engine: drain it (its calls retry elsewhere), restart it, record the loss."""
    c.stats["engine_losses"] += 1
    c.rec.event("engine_lost", engine=m.engine, returncode=m.returncode)
    # The scheduler stops placing on it and moves its executions where there is room;
    # the Drain carrying those routes (ack-less: no role change) is sent after the event.
    c.fleet.lost(m.engine)
    c.feed(ev.EngineLost(m.engine))
    cell = c.fleet.cell_of(m.engine, c.k)
    role = c.sched.roles[cell] if cell is not None else Role.ROLLOUT
    c.to_rank(c.ranks.engines[m.engine], msg.Respawn(role))


def judge_ready(c: CoordinatorState, m: msg.JudgeReady) -> None:
    """A judge engine that died serves again, at a new URL: the proxy node's judge asks it
    from now on (`SetJudges`); the verdicts that failed meanwhile were retried, not zeroed."""
    c.judges[m.judge] = m.url
    c.rec.event("judge_restarted", judge=m.judge, url=m.url)
    c.to_proxy(msg.SetJudges(list(c.judges)))


def engine_ready(c: CoordinatorState, m: msg.EngineReady) -> None:
    """A restarted engine serves again (reloaded if it is older than the policy served)."""
    c.fleet.ready(m.engine, m.url)
    if m.version < c.sched.published:  # restarted from an older copy than served now
        c.to_rank(c.ranks.engines[m.engine], msg.Reload())
    c.rec.event("engine_restarted", engine=m.engine)
    c.to_proxy(msg.SetEngines({str(EngineId(m.engine)): m.url}))
    cell = c.fleet.cell_of(m.engine, c.k)
    if cell is not None and c.sched.roles[cell] is not Role.ROLLOUT:
        c.to_proxy(msg.Drain(str(EngineId(m.engine)), {}, ack=False))
    c.feed(ev.EngineRestored(m.engine))
