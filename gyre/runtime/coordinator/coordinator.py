"""The coordinator (world rank 0): drives the pure scheduler with real processes.

The loop reads top to bottom: take the next message from the proxy node or a cell, turn it
into a scheduler event, and carry out the actions the scheduler returns —

    dispatch  -> record the group (N + k executions), pick its task instance
    launch    -> the proxy node starts the harness, routed to the named engine
    cancel    -> a surplus execution of a group that has its N members stops (oversampling);
                 withdraw: one still queued is closed as never launched
    switch    -> to TRAIN: the proxy drains the source and reroutes its executions, acks,
                 then the cell aborts its calls and releases its engine; to ROLLOUT: the
                 cell resumes its engine, then the proxy routes to it again
    close     -> a terminated execution's tree goes into the trace
    score     -> its verdict (valid or excluded) goes to the scheduler, which makes a group
                 ready once N are valid or all are in
    admit     -> the packing buffer takes the ready group's N members; cells claim passes
    train     -> the training prefix reduces at the core, which updates once
    publish   -> the core pushes weights to every rollout engine and keeps the policy

— exactly as `gyre.sim.Simulator` does with simulated durations. What the coordinator
knows lives beside it: the engines in a `Fleet`, the groups and executions in a `Ledger`,
counters and step rows in `Progress`; a resumed run's take-over is `resume`. Every wait is
bounded (`timeouts.stall_s`; `drain_until`); the run ends after `steps` updates: running
harnesses are cancelled, scored and recorded, the final policy is saved, and every rank is
told to stop.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.config import to_dict
from gyre.runtime.coordinator import resume
from gyre.runtime.coordinator.fleet import Fleet
from gyre.runtime.coordinator.ledger import Execution, ExecutionState, Group, Ledger
from gyre.runtime.coordinator.progress import Progress, StepMetrics
from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.coordinator.training import TrainingPlane
from gyre.runtime.shared import checkpoint, wire
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import RunConfig
from gyre.runtime.shared.layout import PROXY_RANK
from gyre.runtime.shared.startup import StartupClock, StartupProfile
from gyre.schedule import Scheduler, make_policy
from gyre.schedule import events as ev
from gyre.tasks.suite import instance_seed
from gyre.tracking import open_tracker
from gyre.vocabulary import CloseStatus, EngineId, Outcome, Role, VerdictStatus

# what a wait for one message handles meanwhile: executions' reports, restarts, saved policies
REPORTS = (msg.HarnessEnded, msg.Assessed, msg.JournalNode, msg.EngineReady, msg.PolicySaved,
           msg.StartupTimes)  # fmt: skip
# ... and while a checkpoint commits or the run's executions close (every report still
# counts then: an engine restarted before the last update may report back during the close)
CLOSING = (*REPORTS, msg.Checkpointed)
# how a surplus execution closes: cancelled while it ran, or withdrawn before it launched
_SURPLUS = (CloseStatus.CANCELLED, CloseStatus.NOT_LAUNCHED)


class Coordinator:
    """Scheduler + trace + training book-keeping, talking MPI to every other rank."""

    def __init__(
        self, cfg: RunConfig, link: wire.Link, run_dir: Path, engine_ranks: list[int], meta: dict,
        cell_members: list[list[int]] | None = None, startup: StartupClock | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.link, self.run_dir = cfg, link, run_dir
        self.profile = StartupProfile(startup or StartupClock({}))  # start-up, every rank
        self.engine_ranks = engine_ranks  # the rank speaking for each engine (a cell's leader)
        # every rank of each cell: training work goes to all of them, the leader answers
        self.cell_members = cell_members or [[r] for r in engine_ranks[: cfg.topology.cells]]
        self.hosts: list[str] = list(meta.get("hosts", []))  # per world rank: node or host
        sc, pc = cfg.schedule.scheduler(cfg.topology)
        self.sched = Scheduler(sc, make_policy(sc, pc))
        self.n, self.k = sc.group_size, sc.cells
        self.per_group = sc.executions_per_group  # N + k (oversampling)
        self.task_names: list[str] = []  # groups' tasks, round robin: the proxy node's suite
        self.resume = resume.Resume(run_dir)
        self.rec = RunRecorder(run_dir / "trace.h5", meta, self.k)
        self.tracker = open_tracker(cfg.tracking, run_dir, run_config=to_dict(cfg))
        self.train = TrainingPlane(
            cfg.train, groups_per_batch=sc.batch_groups, group_size=sc.group_size,
            send=self.to_cell, audit_dir=run_dir,
        )  # fmt: skip
        self.fleet = Fleet()
        self.ledger = Ledger(self.per_group)
        self.progress = Progress(cfg, self.sched, self.ledger, self.rec, self.tracker)
        self.stats = self.progress.stats
        self.stats.update(surplus_cancelled=0, surplus_withdrawn=0, excluded_replaced=0)
        self.pending: deque[ev.Event] = deque()
        self.updates = 0
        self.trained = list(self.resume.trained)  # groups the current weights have trained
        self.batch_groups: dict[int, list[str]] = {}
        self.checkpoints = checkpoint.Checkpoints(run_dir, cfg.checkpoint)
        if self.resume.state is not None:  # continue from the checkpoint's policy version
            self.updates = self.resume.state.updates
            self.sched.version = self.sched.published = self.resume.state.version
            # batch k is update k+1: numbering goes on, so no batch's records are overwritten
            self.sched.batches_opened = self.updates
        self.status = 0
        self.batch_t0 = self.t0 = self.progress.t0
        self.finishing = False
        self.last_message = time.monotonic()
        self.proxy_url = ""

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict[str, Any]:
        """Start, loop until `steps` updates, finish; returns the summary."""
        self.startup()
        self.feed(ev.Start(carried=self.take_over()))
        deadline = self.t0 + self.cfg.timeouts.run_s
        while self.updates < self.cfg.steps:
            if checkpoint.PREEMPT.is_set():
                return self.checkpoint()
            m = self.next_message(min(1.0, self.cfg.timeouts.stall_s), stall_ok=True)
            if m is not None:
                self.handle(m)
            self.progress.line(self.updates)
            if time.time() > deadline:
                raise wire.RuntimeFailure(f"run exceeded timeouts.run_s={self.cfg.timeouts.run_s}")
        return self.finish()

    def next_message(
        self, timeout: float | None = None, stall_ok: bool = False
    ) -> msg.Message | None:
        """The next message; None after `timeout` when `stall_ok` and the run is not stalled."""
        wait = self.cfg.timeouts.stall_s if timeout is None else timeout
        m = self.link.recv(timeout=wait)
        if m is not None:
            self.last_message = time.monotonic()
            return m
        quiet = time.monotonic() - self.last_message
        if stall_ok and quiet < self.cfg.timeouts.stall_s:
            return None
        raise wire.RuntimeFailure(
            f"no progress for {quiet:.0f}s (step {self.updates}, waterlevel "
            f"{self.sched.waterlevel}, phase {self.sched.phase.value}, roles "
            f"{[r.value for r in self.sched.roles]}); see the logs in {self.run_dir}"
        )

    def drain_until(
        self, done: Callable[[], bool], handled: tuple[type[msg.Message], ...], timeout: float,
        awaited: type[msg.Message] | None = None,
    ) -> None:  # fmt: skip
        """Handle the `handled` messages (others are dropped) until `done()`; after `timeout`
        seconds give up, or fail naming the `awaited` message if one is."""
        deadline = time.time() + timeout
        while not done():
            if time.time() > deadline:
                if awaited is None:
                    return
                raise wire.RuntimeFailure(f"no {awaited.__name__} within {timeout:.0f}s")
            m = self.next_message(max(0.1, deadline - time.time()))
            if isinstance(m, handled):
                self.handle(m)

    def startup(self) -> None:
        """Wait for the proxy and every engine, tell the proxy the engines."""
        needed = {"proxy"} | {f"engine{e}" for e in range(len(self.engine_ranks))}
        while needed:
            m = self.next_message(self.cfg.timeouts.startup_s)
            if isinstance(m, msg.StartupTimes):
                self.startup_times(m)
            elif isinstance(m, msg.ProxyReady):
                needed.discard("proxy")
                self.profile.arrived(PROXY_RANK, "proxy start")
                self.proxy_url, self.task_names = m.url, list(m.tasks)
            elif isinstance(m, msg.EngineReady):
                needed.discard(f"engine{m.engine}")
                self.fleet.ready(m.engine, m.url)
            else:
                raise wire.RuntimeFailure(f"unexpected message at startup: {m!r:.200}")
        self.to_proxy(msg.SetEngines(self.fleet.urls()))
        for c, role in enumerate(self.sched.roles):  # Async: cells fixed in training
            if role is Role.TRAIN:
                self.fleet.fix_in_training(c)  # not a scheduler switch: no SwitchDone
                self.to_proxy(msg.Drain(str(EngineId(c)), {}, ack=False))
                self.to_cell(c, msg.ToTrain())
        self.rec.set_roles(list(self.sched.roles))
        self.rec.event("started", seconds=time.time() - self.t0, proxy=self.proxy_url)
        self.profile.clock.mark("ranks ready")

    def take_over(self) -> tuple[int, ...]:
        """A resumed run: close what the dead job left open, carry its untrained groups
        (`resume`); returns the dispatch versions of the groups that enter the scheduler ready.
        """
        if self.resume.takeover is None:
            return ()
        t0 = time.time()
        self.resume.reopen(self.ledger, self.rec, self.to_proxy)
        recovering = self.resume.recovering

        def one_more_scored(left: int) -> Callable[[], bool]:
            return lambda: len(recovering) < left

        while recovering:  # each rescored execution within timeouts.drain_s
            self.drain_until(one_more_scored(len(recovering)), REPORTS, self.cfg.timeouts.drain_s,
                             awaited=msg.Assessed)  # fmt: skip
        carried, dropped = self.resume.carry(self.ledger)
        self.rec.event("resumed", version=self.sched.version, updates=self.updates,
                       carried=[c.id for c in carried], dropped=dropped,
                       repaired=self.rec.writer.repaired, seconds=time.time() - t0)  # fmt: skip
        return tuple(c.version for c in carried)

    def to_proxy(self, m: msg.Message) -> None:
        self.link.send(m, PROXY_RANK)

    def to_rank(self, rank: int, m: msg.Message) -> None:
        self.link.send(m, rank)

    def to_cell(self, cell: int, m: msg.Message) -> None:
        """A training or role message to every rank of `cell` (each takes its share; the
        leader answers)."""
        for rank in self.cell_members[cell]:
            self.link.send(m, rank)

    # ------------------------------------------------------------------ scheduler actions

    def feed(self, event: ev.Event) -> None:
        """Hand one event to the scheduler and carry out its actions (re-entrant)."""
        self.pending.append(event)
        if len(self.pending) > 1:
            return
        while self.pending:
            for action in self.sched.handle(self.pending[0]):
                ACTIONS[type(action)](self, action)
            self.pending.popleft()
            for drain in self.fleet.drains():
                self.to_proxy(drain)
            self.rec.set_roles(list(self.sched.roles))

    def dispatch(self, a: ev.Dispatch) -> None:
        g = len(self.ledger.groups)
        assert g == a.group, f"groups dispatched out of order: {a.group} after {g - 1}"
        number = self.resume.group_number(a.group)
        task = self.task_names[number % len(self.task_names)]
        group = Group(id=f"g{number}", task=task, version=a.version,
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
        """A surplus execution: its group has its N members; it still closes and is scored."""
        x = self.ledger.executions[a.execution]
        self.stats["surplus_cancelled"] += 1
        self.rec.event("surplus", execution=x.id, group=self.ledger.group_of(a.execution).id,
                       action="cancel")  # fmt: skip
        self.to_proxy(msg.Cancel([x.id]))

    def withdraw(self, a: ev.Withdraw) -> None:
        """A surplus execution that never launched: closed in the trace as not launched."""
        self.stats["surplus_withdrawn"] += 1
        g = self.ledger.group_of(a.execution)
        self.rec.event("surplus", execution=self.ledger.executions[a.execution].id, group=g.id,
                       action="withdraw")  # fmt: skip
        resume.close_not_launched(self.ledger, self.rec, a.execution,
                                  f"surplus: group {g.id} had its {self.n} members first")  # fmt: skip

    def switch(self, a: ev.SwitchCell) -> None:
        self.stats["switches"] += 1
        if a.role is Role.TRAIN:  # the Drain goes once the reroutes are known; Drained: ToTrain
            self.fleet.switch_to_train(a.cell, time.time())
        else:
            self.fleet.switch_to_rollout(a.cell, time.time())
            self.to_cell(a.cell, msg.ToRollout(self.sched.published))

    def reroute(self, a: ev.Reroute) -> None:
        self.stats["reroutes"] += 1
        eid = self.ledger.executions[a.execution].id
        self.fleet.reroute(eid, a.source, a.destination)
        self.rec.event("reroute", execution=eid, source=a.source, destination=a.destination)

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
                       **self.oversampled(a.group, members))  # fmt: skip
        for i in self.ledger.indices(a.group):
            self.replaced(i)
        self.batch_groups.setdefault(a.batch, []).append(g.id)
        count = self.train.admit(g.id, g.version, a.staleness, outcomes, trees)
        for group in self.train.new_set_aside:  # too few usable outcomes (docs/training.md)
            self.rec.event("set_aside", group=group, batch=a.batch)
        self.feed(ev.MicroStepsQueued(batch=a.batch, group=a.group, count=count))

    def oversampled(self, group: int, members: tuple[int, ...]) -> dict[str, list[str]]:
        """Under oversampling, the `admit` event's members and surplus; nothing without."""
        if self.per_group == self.n:
            return {}
        xs = self.ledger.executions
        return {"members": [xs[i].id for i in members],
                "surplus": [xs[i].id for i in self.ledger.indices(group) if i not in members]}  # fmt: skip

    def replaced(self, i: int) -> None:
        """Record an excluded execution (not a cancelled or withdrawn surplus one) whose group
        trains N valid members: oversampling replaced it. Checked when its group is admitted
        and, for a verdict that comes later, when it closes."""
        x = self.ledger.executions[i]
        g = self.ledger.groups[x.group]
        if self.per_group == self.n or g.trained is None or i in g.trained:
            return
        if x.verdict is None or x.verdict.usable or x.outcome in _SURPLUS:
            return
        verdicts = [self.ledger.executions[j].verdict for j in g.trained]
        if all(v is not None and v.usable for v in verdicts):
            self.stats["excluded_replaced"] += 1
            self.rec.event("replaced", execution=x.id, group=g.id)

    def claim(self, a: ev.ClaimMicroStep) -> None:
        self.train.claim(a.cell, a.work)

    def update(self, a: ev.OptimizerUpdate) -> None:
        self.train.update(a.cells)

    def publish(self, a: ev.Publish) -> None:
        targets = [(e, self.fleet[e].url) for e in a.engines]
        self.to_rank(self.engine_ranks[0], msg.Publish(version=a.version, targets=targets))

    # ------------------------------------------------------------------ messages

    def handle(self, m: msg.Message) -> None:
        MESSAGES[type(m)](self, m)

    def drained(self, m: msg.Drained) -> None:
        c = EngineId.parse(m.engine).index
        self.to_cell(c, msg.ToTrain(routes=self.fleet.drained(c)))

    def switched(self, m: msg.Switched) -> None:
        """The cell is in its new role; the whole transition (drain and reroute included,
        the time the cell served neither role) is what the scheduler learns from."""
        total = self.fleet.switched(m.cell, time.time())
        self.progress.switch_seconds.append(total)
        self.rec.event("switch", cell=m.cell, to=m.role.value, seconds=total,
                       cell_seconds=m.seconds, **m.detail)  # fmt: skip
        if m.role is Role.ROLLOUT:
            self.to_proxy(msg.Undrain(str(EngineId(m.cell))))
        if self.fleet.leave_fixed(m.cell):
            return
        self.feed(ev.SwitchDone(m.cell, seconds=total))

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
        self.replaced(m.execution)  # a verdict after its group was admitted
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
        metrics = StepMetrics(
            **self.train.metrics(),
            train_cells=float(len(self.sched.training_cells())),
            duration_s=time.time() - self.batch_t0,
            elapsed_s=time.time() - self.t0,
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
        self.rec.event("publish", version=m.version, seconds=m.seconds, missed=m.missed)
        self.feed(ev.WeightsPublished(m.version))
        for engine in m.missed:  # died around the publication, or restarted before it
            self.to_rank(self.engine_ranks[engine], msg.Reload())

    def policy_saved(self, m: msg.PolicySaved) -> None:
        self.progress.policies.append(m.path)
        self.rec.event("policy", version=m.version, path=m.path)

    def engine_lost(self, m: msg.EngineLost) -> None:
        """A killed engine: drain it (its calls retry elsewhere), restart it, record the loss."""
        self.stats["engine_losses"] += 1
        self.rec.event("engine_lost", engine=m.engine, returncode=m.returncode)
        # The scheduler stops placing on it and moves its executions where there is room;
        # the Drain carrying those routes (ack-less: no role change) is sent by feed().
        self.fleet.lost(m.engine)
        self.feed(ev.EngineLost(m.engine))
        role = self.sched.roles[m.engine] if m.engine < self.k else Role.ROLLOUT
        self.to_rank(self.engine_ranks[m.engine], msg.Respawn(role))

    def startup_times(self, m: msg.StartupTimes) -> None:
        self.profile.add(m.rank, m.component, m.phases)

    def engine_ready(self, m: msg.EngineReady) -> None:
        self.fleet.ready(m.engine, m.url)
        if m.version < self.sched.published:  # restarted from an older copy than served now
            self.to_rank(self.engine_ranks[m.engine], msg.Reload())
        self.rec.event("engine_restarted", engine=m.engine)
        self.to_proxy(msg.SetEngines({str(EngineId(m.engine)): m.url}))
        if m.engine < self.k and self.sched.roles[m.engine] is not Role.ROLLOUT:
            self.to_proxy(msg.Drain(str(EngineId(m.engine)), {}, ack=False))
        self.feed(ev.EngineRestored(m.engine))

    # ------------------------------------------------------------------ checkpoints

    def start_checkpoint(self) -> None:
        """The core saves its weights and optimizer now; `checkpointed` commits the rest.

        The core handles messages in order, so it saves the weights of the update just made
        (nothing can update them before it reads this); the groups those weights trained
        are noted now, with them.
        """
        folder = self.checkpoints.start(self.sched.version, self.updates, self.trained)
        self.to_cell(0, msg.SaveCheckpoint(str(folder)))  # every core rank saves its part

    def checkpointed(self, m: msg.Checkpointed) -> None:
        """Commit the checkpoint the core just saved (its driver state; rename; prune)."""
        next_group = self.resume.group_number(len(self.ledger.groups))
        final = self.checkpoints.finish(m.folder, m.version, next_group)
        self.rec.event("checkpoint", version=m.version, path=str(final), bytes=m.bytes,
                       seconds=m.seconds)  # fmt: skip

    # ------------------------------------------------------------------ end of run

    def checkpoint(self) -> dict[str, Any]:
        """SIGUSR1: record what runs, checkpoint, stop with EXIT_CHECKPOINTED (requeue)."""
        self.rec.event("preempted", step=self.updates)
        self.finishing = True
        if self.checkpoints.writing is None:
            self.start_checkpoint()
        self.status = checkpoint.EXIT_CHECKPOINTED
        return self.finish()

    def await_checkpoint(self) -> None:
        """Until the checkpoint being written (if any) is committed."""
        self.drain_until(lambda: self.checkpoints.writing is None, CLOSING,
                         self.cfg.timeouts.drain_s, awaited=msg.Checkpointed)  # fmt: skip

    def finish(self) -> dict[str, Any]:
        """Checkpoint the last update, cancel running harnesses, record every execution, save
        the policy, stop all ranks.

        A finished run with checkpoints on ends with one of its last update, so `gyre run
        --resume RUN_DIR --steps MORE` continues it (without, it would retrain from the
        newest periodic checkpoint, or from the start)."""
        timeouts = self.cfg.timeouts
        self.finishing = True
        if self.status == 0 and self.checkpoints.enabled:
            self.await_checkpoint()  # a periodic one: one at a time
            if self.checkpoints.updates != self.updates:
                self.start_checkpoint()
        self.await_checkpoint()  # this one, or a preemption's (later drains drop its message)
        self.to_proxy(msg.Cancel([x.id for x in self.ledger.live()]))
        self.drain_until(lambda: not self.ledger.live(), CLOSING, timeouts.drain_s)
        # never stop a cell in the middle of restarting its engine: let the restart finish
        self.drain_until(lambda: not self.fleet.respawning, (msg.EngineReady,), timeouts.startup_s)
        if self.status == 0:
            self.to_rank(self.engine_ranks[0], msg.SavePolicy("final"))
            saved = len(self.progress.policies)
            self.drain_until(lambda: len(self.progress.policies) > saved, REPORTS,
                             timeouts.drain_s, awaited=msg.PolicySaved)  # fmt: skip
        for i in self.ledger.queued():
            resume.close_not_launched(self.ledger, self.rec, i)
        return self._stop()

    def _stop(self) -> dict[str, Any]:
        self.rec.close_roles()
        summary = self.summary()
        brief = {k: v for k, v in summary.items() if k != "steps"}
        self.rec.event("finished", **brief)
        self.rec.close()
        self.tracker.log_summary(brief)
        self.tracker.close()
        self.to_proxy(msg.Stop(self.status))
        followers = [r for members in self.cell_members for r in members[1:]]
        for rank in self.engine_ranks + followers:
            self.to_rank(rank, msg.Stop(self.status))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def summary(self) -> dict[str, Any]:
        hosts = (
            [[self.hosts[r] for r in cell] for cell in self.cell_members] if self.hosts else None
        )
        summary = self.progress.summary(
            self.run_dir, hosts, self.status, self.resume.state, self.updates
        )
        urls = list(self.fleet.urls().values())
        pace = self.progress.pace(self.run_dir, urls, summary["wall_s"])
        if pace is not None:
            summary["pace"] = pace
        summary["startup"] = self.profile.summary()
        return summary


ACTIONS: dict[type, Callable[[Coordinator, Any], None]] = {
    ev.Dispatch: Coordinator.dispatch,
    ev.Launch: Coordinator.launch,
    ev.Cancel: Coordinator.cancel,
    ev.Withdraw: Coordinator.withdraw,
    ev.SwitchCell: Coordinator.switch,
    ev.Reroute: Coordinator.reroute,
    ev.OpenJoinWindow: Coordinator.open_window,
    ev.CloseJoinWindow: Coordinator.close_window,
    ev.AdmitGroup: Coordinator.admit,
    ev.ClaimMicroStep: Coordinator.claim,
    ev.OptimizerUpdate: Coordinator.update,
    ev.Publish: Coordinator.publish,
}
MESSAGES: dict[type, Callable[[Coordinator, Any], None]] = {
    msg.Drained: Coordinator.drained,
    msg.Switched: Coordinator.switched,
    msg.HarnessEnded: Coordinator.terminated,
    msg.JournalNode: Coordinator.journal,
    msg.Assessed: Coordinator.assessed,
    msg.Prepassed: Coordinator.prepassed,
    msg.Accumulated: Coordinator.accumulated,
    msg.Updated: Coordinator.updated,
    msg.Published: Coordinator.published,
    msg.PolicySaved: Coordinator.policy_saved,
    msg.EngineLost: Coordinator.engine_lost,
    msg.EngineReady: Coordinator.engine_ready,
    msg.Checkpointed: Coordinator.checkpointed,
    msg.StartupTimes: Coordinator.startup_times,
}
