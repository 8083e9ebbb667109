"""Validation while training at the coordinator (`eval.every_steps`; docs/runtime.md
"Validation while training").

    start     -> at step 0 and whenever a publication reaches the next due step (every
                 `every_steps`), the proxy node runs the held-out set on the rollout engines
                 (`msg.Evaluate`; `gyre.runtime.shared.heldout.run_heldout`, as `gyre eval`
                 runs it); one at a time: a due one starts when the one in flight is in.
                 Training never waits for it, and its executions never enter the ledger,
                 the trace's executions or a batch
    evaluated -> its mean reward is the curve point `eval/reward_mean` at its step: the trace
                 (`steps` rows `eval/*`; an `eval` event with when it ran, the engines and
                 policy versions that served it, its samples), the trackers (`eval/*`,
                 `eval.log_samples` transcripts as text), `summary.json` `evals`
    finish    -> after the last update: its point (when due) on the final policy, served by
                 the core's engine (back in rollout for it), and the one in flight awaited

Functions of the coordinator's state (`CoordinatorState`), which holds a `Validation`
(progress.py: when the next is due, the points recorded).
"""

from __future__ import annotations

import math
import time
from typing import Any

from gyre.runtime.coordinator.inbox import CLOSING
from gyre.runtime.coordinator.progress import point
from gyre.runtime.coordinator.state import CoordinatorState
from gyre.runtime.shared import messages as msg
from gyre.vocabulary import EngineId, Role

CURVE = ("reward_mean", "reward_std", "scored", "excluded")
"""A point's numbers on the curve: the trace's `eval/<name>` rows, the trackers' (as `gyre eval`'s)."""


def start(c: CoordinatorState, version: int, engine: str | None = None) -> None:
    """Start the evaluation of `version` (the policy the engines serve) if one is due."""
    v = c.validation
    if not v.due(version):
        return
    v.in_flight = version
    v.next_due = (version // v.every + 1) * v.every
    c.to_proxy(msg.Evaluate(version, engine))


def evaluated(c: CoordinatorState, m: msg.Evaluated) -> None:
    """Record the point (trace, trackers, summary); start the next one if it is due."""
    v = c.validation
    v.in_flight = None
    p = point(m)
    v.points.append(p)
    c.rec.step(m.step, {f"eval/{k}": p[k] for k in (*CURVE, "seconds")})
    c.rec.event("eval", **p, rewards=m.rewards, samples=m.samples)
    c.tracker.log_eval(m.step, {k: p[k] for k in CURVE})
    if m.samples:
        c.tracker.log_samples(m.step, m.samples)
    print(f"GYRE-EVAL step {m.step}: held-out reward {p['reward_mean']:.3f} ± {p['reward_std']:.3f} "
          f"({p['scored']} scored, {p['excluded']} excluded, {p['seconds']:.0f}s, policy "
          f"versions {p['versions']})", flush=True)  # fmt: skip
    if not c.finishing:
        start(c, c.sched.published)


def finish(c: CoordinatorState) -> None:
    """After the last update: the evaluation in flight, then the final step's (when due),
    both served by the core's engine holding the final weights. Bounded: an evaluation
    that does not come back in time is a warning, never a failed run."""
    v, version = c.validation, c.updates  # the final policy's version (the scheduler's
    # counts the batches it closed: the last one it never hears of)
    final_due = c.status == 0 and v.every > 0 and version >= v.next_due
    if v.in_flight is None and not final_due:
        return
    _serve_final(c, version)
    bound = _bound(c)
    c.inbox.drain_until(lambda: v.in_flight is None, CLOSING, bound)
    if v.in_flight is None and final_due:
        v.next_due = version  # due now, whatever was due before
        start(c, version, engine=str(EngineId(0)))
        c.inbox.drain_until(lambda: v.in_flight is None, CLOSING, bound)
    if v.in_flight is not None:
        print(
            f"GYRE-WARNING the held-out evaluation of step {v.in_flight} did not finish "
            f"within {bound:.0f}s; `gyre eval RUN_DIR` scores the final policy",
            flush=True,
        )


def _serve_final(c: CoordinatorState, version: int) -> None:
    """The core's engine serves `version`: the core goes back to rollout (its engine loads
    its replica's weights) or, already there, gets the final weights published."""
    core = 0
    if c.sched.roles[core] is Role.ROLLOUT:
        targets = [(e, c.fleet[e].url) for e in c.fleet.of_cell(core)]
        c.published_to[version] = [url for _, url in targets]
        c.to_cell(core, msg.Publish(version=version, targets=targets))
        _await(c, lambda m: isinstance(m, msg.Published) and m.version == version)
        return
    c.to_cell(core, msg.ToRollout(version))
    _await(c, lambda m: isinstance(m, msg.Switched) and m.cell == core)
    roles = list(c.sched.roles)
    roles[core] = Role.ROLLOUT
    c.rec.set_roles(roles)
    for e in c.fleet.of_cell(core):
        c.to_proxy(msg.Undrain(str(EngineId(e))))


def _await(c: CoordinatorState, done: Any) -> None:
    """Until a message `done(m)` (others a closing run handles are handled meanwhile)."""
    deadline = time.time() + c.cfg.timeouts.startup_s
    while time.time() < deadline:
        m = c.inbox.next(max(0.1, deadline - time.time()))
        if done(m):
            return
        if isinstance(m, CLOSING):
            c.inbox.handle(m)


def _bound(c: CoordinatorState) -> float:
    """How long an evaluation may take: its executions in waves of `eval.concurrency`, each
    within the harness's overall budget, plus the drain allowance."""
    e = c.cfg.eval
    tasks = len(e.tasks) if e.suite is not None and e.tasks else max(1, len(c.cfg.harness.tasks))
    waves = math.ceil(e.instances * tasks / e.concurrency)
    return waves * c.cfg.harness.overall_timeout_s + c.cfg.timeouts.drain_s
