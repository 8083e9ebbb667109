"""How a run ends at the coordinator, and the checkpoints that let another job continue it
(docs/runtime.md "Crashes and resume"): the last checkpoint, every execution closed, the
final policy, every rank stopped, the summary.

    start_checkpoint -> when `checkpoint` asks (every_steps, every_minutes) and at the end:
                        the core saves its weights and optimizer; `checkpointed` commits
    finish           -> after `steps` updates: checkpoint the last update (checkpoints on),
                        cancel the running harnesses and record every execution (scored, or
                        not launched), let a restarting engine come up, save
                        `policies/final`, the last held-out point (validation.py), then
                        `stop`
    preempted        -> SIGUSR1 (Slurm's warning before the time limit): record it,
                        checkpoint now, `finish` with EXIT_CHECKPOINTED (the job is requeued
                        and resumes)
    stop             -> `finished` event, trace and trackers closed, `Stop` to every rank,
                        `summary.json` written

Every wait here is bounded (`timeouts.drain_s`, `timeouts.startup_s`) and handles the
messages a closing run still gets (`CLOSING`). Functions of the coordinator's state
(`CoordinatorState`).
"""

from __future__ import annotations

import json
from typing import Any

from gyre.runtime.coordinator import resume, validation
from gyre.runtime.coordinator.inbox import CLOSING, REPORTS
from gyre.runtime.coordinator.state import CoordinatorState
from gyre.runtime.shared import checkpoint
from gyre.runtime.shared import messages as msg


def start_checkpoint(c: CoordinatorState) -> None:
    """The core saves its weights and optimizer now; `checkpointed` commits the rest.

    The core handles messages in order, so it saves the weights of the update just made
    (nothing can update them before it reads this); the groups those weights trained
    are noted now, with them.
    """
    folder = c.checkpoints.start(c.sched.version, c.updates, c.trained)
    c.to_cell(0, msg.SaveCheckpoint(str(folder)))  # every core rank saves its part


def checkpointed(c: CoordinatorState, m: msg.Checkpointed) -> None:
    """Commit the checkpoint the core just saved (its driver state; rename; prune)."""
    next_group = c.resume.group_number(len(c.ledger.groups))
    final = c.checkpoints.finish(m.folder, m.version, next_group)
    c.rec.event("checkpoint", version=m.version, path=str(final), bytes=m.bytes,
                seconds=m.seconds)  # fmt: skip


def preempted(c: CoordinatorState) -> dict[str, Any]:
    """SIGUSR1: record what runs, checkpoint, stop with EXIT_CHECKPOINTED (requeue)."""
    c.rec.event("preempted", step=c.updates)
    c.finishing = True
    if c.checkpoints.writing is None:
        start_checkpoint(c)
    c.status = checkpoint.EXIT_CHECKPOINTED
    return finish(c)


def await_checkpoint(c: CoordinatorState) -> None:
    """Until the checkpoint being written (if any) is committed."""
    c.inbox.drain_until(lambda: c.checkpoints.writing is None, CLOSING, c.cfg.timeouts.drain_s,
                  awaited=msg.Checkpointed)  # fmt: skip


def finish(c: CoordinatorState) -> dict[str, Any]:
    """Checkpoint the last update, cancel running harnesses, record every execution, save
    the policy, stop all ranks.

    A finished run with checkpoints on ends with one of its last update, so `gyre run
    --resume RUN_DIR --steps MORE` continues it (without, it would retrain from the
    newest periodic checkpoint, or from the start)."""
    timeouts = c.cfg.timeouts
    c.finishing = True
    if c.status == 0 and c.checkpoints.enabled:
        await_checkpoint(c)  # a periodic one: one at a time
        if c.checkpoints.updates != c.updates:
            start_checkpoint(c)
    await_checkpoint(c)  # this one, or a preemption's (later drains drop its message)
    c.to_proxy(msg.Cancel([x.id for x in c.ledger.live()]))
    c.inbox.drain_until(lambda: not c.ledger.live(), CLOSING, timeouts.drain_s)
    # never stop a cell in the middle of restarting its engine: let the restart finish
    c.inbox.drain_until(lambda: not c.fleet.respawning, (msg.EngineReady,), timeouts.startup_s)
    if c.status == 0:
        c.to_cell(0, msg.SavePolicy("final"))  # every core rank writes its part
        saved = len(c.progress.policies)
        c.inbox.drain_until(lambda: len(c.progress.policies) > saved, REPORTS, timeouts.drain_s,
                      awaited=msg.PolicySaved)  # fmt: skip
    validation.finish(c)  # the last held-out point, on the final policy (eval.every_steps)
    for i in c.ledger.queued():
        resume.close_not_launched(c.ledger, c.rec, i)
    return stop(c)


def stop(c: CoordinatorState) -> dict[str, Any]:
    """Close the trace and the trackers, stop every rank, write `summary.json`."""
    c.rec.close_roles()
    result = summary(c)
    brief = {k: v for k, v in result.items() if k != "steps"}
    c.rec.event("finished", **brief)
    c.rec.close()
    c.tracker.log_summary(brief)
    c.tracker.close()
    c.to_proxy(msg.Stop(c.status))
    for rank in c.ranks.cells_and_engines:
        c.to_rank(rank, msg.Stop(c.status))
    (c.run_dir / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def summary(c: CoordinatorState) -> dict[str, Any]:
    """`summary.json`: the run's figures (`Progress.summary`), its pace, its start-up."""
    hosts = c.ranks.by_cell(c.hosts) if c.hosts else None
    result = c.progress.summary(c.run_dir, hosts, c.status, c.resume.state, c.updates)
    pace = c.progress.pace(c.run_dir, list(c.fleet.urls().values()), result["wall_s"])
    if pace is not None:
        result["pace"] = pace
    result["startup"] = c.profile.summary()
    if c.judges:  # topology.judge_engines: where the judge was served (never published to)
        result["judge_engines"] = list(c.judges)
    if c.validation.points:  # eval.every_steps: the held-out curve
        result["evals"] = c.validation.points
    return result
