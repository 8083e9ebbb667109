"""The coordinator (world rank 0): drives the pure scheduler with real processes.

The loop reads top to bottom: take the next message from the proxy node or a cell, turn it
into a scheduler event, and carry out the actions the scheduler returns (through `Feed`,
the loop `gyre.sim.Simulator` runs with simulated durations) —

    dispatch  -> record the group (N + k executions), pick its task instance
    launch    -> the proxy node starts the harness, routed to the named engine
    cancel    -> a surplus execution of a group that has its N members stops; withdraw: one
                 still queued is closed as never launched (oversampling.py)
    switch    -> to TRAIN: the proxy drains the source and reroutes its executions, acks,
                 then the cell aborts its calls and releases its engine; to ROLLOUT: the
                 cell resumes its engine, then the proxy routes to it again (engines.py)
    close     -> a terminated execution's tree goes into the trace
    score     -> its verdict (valid or excluded) goes to the scheduler, which makes a group
                 ready once N are valid or all are in
    admit     -> the packing buffer takes the ready group's N members; cells claim passes
    train     -> the training prefix reduces at the core, which updates once
    publish   -> the core pushes weights to every rollout engine and keeps the policy
    evaluate  -> at step 0 and every eval.every_steps publications, the held-out set runs on
                 the rollout engines beside training; its points are recorded (validation.py)

Around the loop: its start (opening.py: every rank ready, a resumed run's take-over) and its
end after `steps` updates (closing.py: checkpoints, every execution closed, the final policy,
every rank stopped); every wait is bounded (inbox.py). What the coordinator knows is its
`CoordinatorState` (state.py): the engines in a `Fleet`, the groups and executions in a
`Ledger`, counters and step rows in `Progress`, the ranks it talks to in `Ranks`, ...
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.runtime.coordinator import closing, engines, opening, validation
from gyre.runtime.coordinator.inbox import Inbox
from gyre.runtime.coordinator.ledger import Execution, ExecutionState, GroupRecord
from gyre.runtime.coordinator.progress import StepMetrics
from gyre.runtime.coordinator.state import CoordinatorState
from gyre.runtime.shared import checkpoint, wire
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import RunConfig
from gyre.runtime.shared.layout import Ranks
from gyre.runtime.shared.startup import StartupClock
from gyre.schedule import Feed
from gyre.schedule import events as ev
from gyre.tasks.suite import instance_seed
from gyre.vocabulary import CloseStatus, EngineId, Outcome, VerdictStatus


class Coordinator(CoordinatorState):
    """The loop: messages in, scheduler events, actions out, over the `CoordinatorState`."""

    def __init__(
        self, cfg: RunConfig, link: wire.Link, run_dir: Path, ranks: Ranks | list[int],
        meta: dict, startup: StartupClock | None = None,
    ) -> None:  # fmt: skip
        super().__init__(cfg, link, run_dir, ranks, meta, startup)
        self.feed = Feed(self.sched, ACTIONS, self, after=self.after_event)
        self.inbox = Inbox(link, cfg.timeouts, run_dir, handle=self.handle, where=self.where)

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict[str, Any]:
        """Start, loop until `steps` updates, finish; returns the summary."""
        self.startup()
        self.feed(ev.Start(carried=opening.take_over(self)))
        validation.start(self, self.sched.published)  # step 0's held-out point (eval.every_steps)
        deadline = self.t0 + self.cfg.timeouts.run_s
        while self.updates < self.cfg.steps:
            if checkpoint.PREEMPT.is_set():
                return closing.preempted(self)
            m = self.inbox.next(min(1.0, self.cfg.timeouts.stall_s), stall_ok=True)
            if m is not None:
                self.handle(m)
            self.progress.line(self.updates)
            if time.time() > deadline:
                raise wire.RuntimeFailure(f"run exceeded timeouts.run_s={self.cfg.timeouts.run_s}")
        return self.finish()

    def startup(self) -> None:
        """Wait for the proxy and every engine, tell the proxy the engines (opening.py)."""
        opening.startup(self)

    # ------------------------------------------------------------------ scheduler actions

    def after_event(self) -> None:
        """Once an event's actions are carried out (`feed`): the drains the fleet owes the
        proxy, and the cells' roles into the trace."""
        engines.drains(self)
        self.rec.set_roles(list(self.sched.roles))

    def dispatch(self, a: ev.Dispatch) -> None:
        g = len(self.ledger.groups)
        assert g == a.group, f"groups dispatched out of order: {a.group} after {g - 1}"
        number = self.resume.group_number(a.group)
        task = self.task_names[number % len(self.task_names)]
        group = GroupRecord(id=f"g{number}", task=task, version=a.version,
                      instance=instance_seed(self.cfg.train.seed, number))  # fmt: skip
        ids = [f"{group.id}-e{x - a.executions[0]}" for x in a.executions]
        self.ledger.add(group, [Execution(id=i, group=g) for i in ids])
        self.rec.groups(group.id, f"{task}@{group.instance}", ids, a.version)
        self.rec.dispatch(a.version, 1, len(a.executions), self.sched)

    def launch(self, a: ev.Launch) -> None:
        if self.finishing:
            return
        x, g = self.ledger.executions[a.execution], self.ledger.group_of(a.execution)
        x.state = ExecutionState.RUNNING
        engine = str(EngineId(a.engine))
        self.rec.open_execution(x.id, {"group": g.id, "task": g.task, "instance": g.instance,
                                       "engine": engine})  # fmt: skip
        self.to_proxy(msg.StartExecution(execution=a.execution, execution_id=x.id, task=g.task,
                                         instance=g.instance, engine=engine))  # fmt: skip

    def cancel(self, a: ev.Cancel) -> None:
        self.oversampling.cancel(a)

    def withdraw(self, a: ev.Withdraw) -> None:
        self.oversampling.withdraw(a)

    def open_window(self, a: ev.OpenJoinWindow) -> None:
        self.train.begin(a.batch, self.sched.version)
        self.batch_t0 = time.time()
        self.rec.event("join_window", batch=a.batch, open=True)

    def close_window(self, a: ev.CloseJoinWindow) -> None:
        self.rec.event("join_window", batch=a.batch, open=False)

    def admit(self, a: ev.AdmitGroup) -> None:
        g = self.ledger.groups[a.group]
        self.profile.once("first group")  # dispatched, rolled out, scored: ready to train
        members = a.members or self.ledger.trained(a.group, self.n)  # () : carried in
        outcomes, trees = self.ledger.outcomes(a.group, members)
        self.rec.event("admit", group=g.id, batch=a.batch, staleness=a.staleness,
                       **self.oversampling.split(a.group, members))  # fmt: skip
        self.oversampling.admitted(a.group)
        self.batch_groups.setdefault(a.batch, []).append(g.id)
        count = self.train.admit(g.id, g.version, a.staleness, outcomes, trees, task=g.task)
        for group in self.train.new_set_aside:  # too few usable outcomes (docs/training.md)
            self.rec.event("set_aside", group=group, batch=a.batch)
        self.feed(ev.MicroStepsQueued(batch=a.batch, group=a.group, count=count))

    def claim(self, a: ev.ClaimMicroStep) -> None:
        self.train.claim(a.cell, a.work, a.count)

    def update(self, a: ev.OptimizerUpdate) -> None:
        self.train.update(a.cells)

    def publish(self, a: ev.Publish) -> None:
        targets = [(e, self.fleet[e].url) for e in a.engines]
        self.published_to[a.version] = [url for _, url in targets]
        self.to_cell(0, msg.Publish(version=a.version, targets=targets))  # each rank sends its part

    # ------------------------------------------------------------------ messages

    def handle(self, m: msg.Message) -> None:
        MESSAGES[type(m)](self, m)

    def terminated(self, m: msg.HarnessEnded) -> None:
        x = self.ledger.executions[m.execution]
        x.state, x.outcome = ExecutionState.TERMINATED, CloseStatus.of(m.outcome)
        x.reason = m.reason
        x.t_ended = time.time()  # the slot is free from here: the replay's run time ends here
        if m.outcome not in (Outcome.COMPLETED, Outcome.CANCELLED):
            self.rec.event("terminated", execution=x.id, outcome=m.outcome.value, reason=m.reason)
        if not self.finishing:
            self.feed(ev.Terminated(m.execution, m.outcome))

    def journal(self, m: msg.JournalNode) -> None:
        self.rec.journal(m.execution_id, m.node)
        self.sampled_tokens += len(m.node.output_ids)

    def assessed(self, m: msg.Assessed) -> None:
        """Close the execution into the trace with its verdict, then score its group."""
        self.stats["harness_errors"] += m.errors
        if self.close(m):
            self.score(m.execution)

    def close(self, m: msg.Assessed) -> bool:
        """The execution's tree and verdict into the trace; False for a taken-over one."""
        x, g = self.ledger.executions[m.execution], self.ledger.group_of(m.execution)
        recovered = self.resume.recovering.pop(m.execution, None)
        tree = recovered if recovered is not None else self.rec.journaled_tree(x.id)
        status = x.outcome if x.state is ExecutionState.TERMINATED else CloseStatus.FAILED
        self.rec.close_execution(x.id, g.id, tree, status, m.verdict, t_ended=x.t_ended)
        if m.verdict.status is VerdictStatus.EXCLUDED:
            self.rec.event("excluded", execution=x.id, error=m.verdict.error)
        x.state, x.verdict = ExecutionState.RECORDED, m.verdict
        if m.verdict.status is VerdictStatus.SCORED and g.trained is None:
            x.tree = tree
        self.oversampling.replaced(m.execution)  # a verdict after its group was admitted
        return recovered is None  # a resumed run's takeover: the scheduler has not started yet

    def score(self, execution: int) -> None:
        """One more verdict for the group: the scheduler makes the group ready once N of its
        executions are valid (usable), or all N + k are in."""
        x = self.ledger.executions[execution]
        self.ledger.groups[x.group].assessed += 1
        if not self.finishing:
            assert x.verdict is not None
            self.feed(ev.Assessed(execution, valid=x.verdict.usable))

    def prepassed(self, m: msg.Prepassed) -> None:
        if self.finishing:
            return
        ready = self.train.prepassed(m)
        self.feed(ev.MicroStepDone(cell=m.cell, batch=m.batch, seconds=m.seconds))
        if ready:
            self.feed(ev.GradientsReady(batch=m.batch, count=ready))

    def accumulated(self, m: msg.Accumulated) -> None:
        if self.finishing:
            return
        self.train.accumulated(m)
        self.feed(ev.MicroStepDone(cell=m.cell, batch=m.batch, seconds=m.seconds))

    def updated(self, m: msg.Updated) -> None:
        if not self.train.updated(m):
            return
        self.updates += 1
        self.profile.first_step()
        self.trained += self.batch_groups.pop(m.batch, [])
        now, (last_t, last_sampled) = time.time(), self.last_update
        self.last_update = (now, self.sampled_tokens)
        metrics = StepMetrics(
            **self.train.metrics(),
            lr=self.cfg.train.lr_at(self.train.version, self.cfg.steps),  # the cells' schedule
            train_cells=float(len(self.sched.training_cells())),
            step_s=now - last_t,
            rollout_tokens_per_s=(self.sampled_tokens - last_sampled) / max(now - last_t, 1e-9),
            duration_s=now - self.batch_t0,
            elapsed_s=now - self.t0,
            task_rewards=self.train.task_rewards(),
        )
        self.progress.step(self.updates, metrics)
        if self.updates >= self.cfg.steps:
            self.finishing = True  # nothing new starts: no satellite return, no publication
            return
        self.feed(ev.BatchDone(m.batch))
        if self.checkpoints.due(self.updates):
            self.start_checkpoint()

    def published(self, m: msg.Published) -> None:
        self.stats["publications"] += 1
        self.rec.event("publish", version=m.version, seconds=m.seconds, missed=m.missed,
                       urls=self.published_to.pop(m.version, []))  # fmt: skip
        self.feed(ev.WeightsPublished(m.version))
        for engine in m.missed:  # died around the publication, or restarted before it
            self.to_rank(self.ranks.engines[engine], msg.Reload())
        validation.start(self, m.version)  # a held-out point, when one is due

    def policy_saved(self, m: msg.PolicySaved) -> None:
        self.progress.policies.append(m.path)
        self.rec.event("policy", version=m.version, path=m.path)

    def startup_times(self, m: msg.StartupTimes) -> None:
        self.profile.add(m.rank, m.component, m.phases)

    # ------------------------------------------------------------------ checkpoints, end of run

    def start_checkpoint(self) -> None:
        """The core saves its weights and optimizer now; `closing.checkpointed` commits."""
        closing.start_checkpoint(self)

    def finish(self) -> dict[str, Any]:
        """After `steps` updates: close every execution, save the policy, stop every rank."""
        return closing.finish(self)

    def summary(self) -> dict[str, Any]:
        return closing.summary(self)


ACTIONS: dict[type, Callable[[Coordinator, Any], None]] = {
    ev.Dispatch: Coordinator.dispatch,
    ev.Launch: Coordinator.launch,
    ev.Cancel: Coordinator.cancel,
    ev.Withdraw: Coordinator.withdraw,
    ev.SwitchCell: engines.switch,
    ev.Reroute: engines.reroute,
    ev.OpenJoinWindow: Coordinator.open_window,
    ev.CloseJoinWindow: Coordinator.close_window,
    ev.AdmitGroup: Coordinator.admit,
    ev.ClaimMicroStep: Coordinator.claim,
    ev.OptimizerUpdate: Coordinator.update,
    ev.Publish: Coordinator.publish,
}
MESSAGES: dict[type, Callable[[Coordinator, Any], None]] = {
    msg.Drained: engines.drained,
    msg.Switched: engines.switched,
    msg.HarnessEnded: Coordinator.terminated,
    msg.JournalNode: Coordinator.journal,
    msg.Assessed: Coordinator.assessed,
    msg.Prepassed: Coordinator.prepassed,
    msg.Accumulated: Coordinator.accumulated,
    msg.Updated: Coordinator.updated,
    msg.Published: Coordinator.published,
    msg.PolicySaved: Coordinator.policy_saved,
    msg.EngineLost: engines.engine_lost,
    msg.EngineReady: engines.engine_ready,
    msg.JudgeReady: engines.judge_ready,
    msg.Checkpointed: closing.checkpointed,
    msg.StartupTimes: Coordinator.startup_times,
    msg.Evaluated: validation.evaluated,
}
