"""The coordinator (world rank 0): drives the pure scheduler with real processes.

The loop reads top to bottom: take the next message from the proxy node or a cell, turn it
into a scheduler event, and carry out the actions the scheduler returns —

    dispatch  -> record the group, pick its task instance
    launch    -> the proxy node starts the harness, routed to the named engine
    switch    -> to TRAIN: the proxy drains the source and reroutes its executions, acks,
                 then the cell aborts its calls and releases its engine; to ROLLOUT: the
                 cell resumes its engine, then the proxy routes to it again
    close     -> a terminated execution's tree goes into the trace
    score     -> its verdict completes the group; a complete group is ready
    admit     -> the packing buffer takes the ready group; cells claim micro-step passes
    train     -> the training prefix reduces at the core, which updates once
    publish   -> the core pushes weights to every rollout engine and keeps the policy

— exactly as `gyre.sim.Simulator` does with simulated durations. Every wait is bounded
(`timeouts.stall_s`); the run ends after `steps` updates: running harnesses are cancelled,
scored and recorded, the final policy is saved, and every rank is told to stop.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gyre.config import to_dict
from gyre.runtime import checkpoint, recovery, wire
from gyre.runtime import messages as msg
from gyre.runtime.config import RunConfig
from gyre.runtime.layout import PROXY_RANK
from gyre.runtime.record import RunRecorder
from gyre.runtime.training import TrainingPlane
from gyre.schedule import Scheduler, make_policy
from gyre.schedule import events as ev
from gyre.tasks.suite import instance_seed
from gyre.tracking import open_tracker
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.vocabulary import EngineId, Outcome, Role, VerdictStatus


@dataclass(slots=True)
class Execution:
    """Everything the coordinator knows about one dispatched execution."""

    id: str
    group: int
    state: Literal["queued", "running", "terminated", "recorded"] = "queued"
    # its close status in the trace: the harness's `Outcome` value (completed, failed,
    # timed_out, cancelled), or not_launched | unrecoverable | recovered
    outcome: str = "not_launched"
    reason: str = ""  # why the harness did not complete
    verdict: msg.VerdictRecord | None = None
    tree: Any = None  # kept from scoring until its group is admitted

    @property
    def live(self) -> bool:
        return self.state in ("running", "terminated")


@dataclass(slots=True)
class Group:
    """One dispatched group: its task instance, dispatch version and scoring progress."""

    id: str
    task: str
    instance: int
    version: int
    assessed: int = 0


class Coordinator:
    """Scheduler + trace + training book-keeping, talking MPI to every other rank."""

    def __init__(
        self, cfg: RunConfig, link: wire.Link, run_dir: Path, engine_ranks: list[int], meta: dict,
        cell_members: list[list[int]] | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.link, self.run_dir = cfg, link, run_dir
        self.engine_ranks = engine_ranks  # the rank speaking for each engine (a cell's leader)
        # every rank of each cell: training work goes to all of them, the leader answers
        self.cell_members = cell_members or [[r] for r in engine_ranks[: cfg.topology.cells]]
        self.hosts: list[str] = list(meta.get("hosts", []))  # per world rank: node or host
        sc, pc = cfg.schedule.scheduler(cfg.topology)
        self.sched = Scheduler(sc, make_policy(sc, pc))
        self.n = sc.group_size
        self.k = sc.cells
        from gyre.runtime.proxy_node import load_tasks

        _, self.task_names = load_tasks(cfg)
        found = checkpoint.latest(run_dir)
        self.resumed = found[1] if found is not None else None
        trace = run_dir / "trace.h5"
        trained = set(self.resumed["trained"]) if self.resumed else set()
        self.takeover = recovery.read_trace(trace, trained) if trace.exists() else None
        self.rec = RunRecorder(trace, meta, self.k)
        self.tracker = open_tracker(cfg.tracking, run_dir, run_config=to_dict(cfg))
        self.train = TrainingPlane(
            cfg.train, groups_per_batch=sc.batch_groups, group_size=sc.group_size,
            send=self.to_cell, audit_dir=run_dir,
        )  # fmt: skip
        self.pending: deque[ev.Event] = deque()
        self.urls: dict[int, str] = {}
        self.drain_routes: dict[int, dict[str, str]] = {}  # cell -> {execution: engine id}
        self.kv_routes: dict[int, dict[str, str]] = {}  # cell -> {execution: new engine's URL}
        self.switch_started: dict[int, float] = {}  # cell -> when its switch was decided
        self.fixed_train: set[int] = set()
        self.executions: list[Execution] = []
        self.groups: list[Group] = []
        self.respawning: set[int] = set()  # engines lost and not yet back
        self.switching_to_train: set[int] = set()  # cells whose acknowledged Drain is unsent
        self.updates = 0
        self.trained: list[str] = sorted(trained)  # groups the current weights have trained
        self.batch_groups: dict[int, list[str]] = {}
        self.first_new_group = self.takeover.next_group if self.takeover else 0
        self.carried = 0  # scheduler groups 0..carried-1 were taken over from the trace
        self.recovering: dict[int, Any] = {}  # execution index -> its journaled partial tree
        self.last_checkpoint = time.time()
        self.checkpoint_folder: tuple[Path, list[str]] | None = None  # being written
        if self.resumed is not None:  # continue from the checkpoint's policy version
            self.updates = int(self.resumed["updates"])
            self.sched.version = self.sched.published = int(self.resumed["version"])
            # batch k is update k+1: numbering goes on, so no batch's records are overwritten
            self.sched.batches_opened = self.updates
        self.status = 0
        self.batch_t0 = time.time()
        self.stats = {"reroutes": 0, "switches": 0, "harness_errors": 0, "engine_losses": 0,
                      "publications": 0, "no_signal_steps": 0, "empty_steps": 0,
                      "set_aside_groups": 0}  # fmt: skip
        self.empty_in_a_row = 0
        self.switch_seconds: list[float] = []
        self.step_rows: list[dict[str, float]] = []
        self.policies: list[str] = []
        self.last_progress = 0.0
        self.t0 = time.time()
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
            self.progress()
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

    def startup(self) -> None:
        """Wait for the proxy and every engine, tell the proxy the engines."""
        needed = {"proxy"} | {f"engine{e}" for e in range(len(self.engine_ranks))}
        while needed:
            m = self.next_message(self.cfg.timeouts.startup_s)
            if isinstance(m, msg.ProxyReady):
                needed.discard("proxy")
                self.proxy_url = m.url
            elif isinstance(m, msg.EngineReady):
                needed.discard(f"engine{m.engine}")
                self.urls[m.engine] = m.url
            else:
                raise wire.RuntimeFailure(f"unexpected message at startup: {m!r:.200}")
        self.to_proxy(msg.SetEngines({str(EngineId(e)): u for e, u in self.urls.items()}))
        for c, role in enumerate(self.sched.roles):  # Async: cells fixed in training
            if role is Role.TRAIN:
                self.fixed_train.add(c)  # not a scheduler switch: no SwitchDone
                self.to_proxy(msg.Drain(str(EngineId(c)), {}, ack=False))
                self.to_rank(self.engine_ranks[c], msg.ToTrain())
        self.rec.set_roles(list(self.sched.roles))
        self.rec.event("started", seconds=time.time() - self.t0, proxy=self.proxy_url)

    def take_over(self) -> tuple[int, ...]:
        """A resumed run: close what the dead job left open, carry its untrained groups.

        Executions that were running are scored from their preserved workspaces (on the
        proxy node, which holds them) and closed with their journaled trees; executions
        that never launched are closed as such. Every untrained group with a valid
        execution then enters the scheduler ready, with its dispatch version; returns those.
        """
        if self.takeover is None:
            return ()
        t0 = time.time()
        carried: list[recovery.CarriedGroup] = []
        dropped = []
        for cg in self.takeover.groups:
            if len(cg.members) != self.n:
                raise wire.RuntimeFailure(
                    f"resume: group {cg.id} has {len(cg.members)} executions, the config's "
                    f"schedule.group_size is {self.n}; resume with the run's own config.yaml"
                )
            g = len(self.groups)
            self.groups.append(Group(cg.id, cg.task, cg.instance, cg.version))
            for m in cg.members:
                x = Execution(id=m.id, group=g, state="recorded", outcome=m.outcome,
                              verdict=m.verdict, tree=m.tree)  # fmt: skip
                self.executions.append(x)
                if m.state == "open" and m.tree is not None and len(m.tree):
                    x.state, x.outcome = "terminated", "recovered"
                    self.recovering[len(self.executions) - 1] = m.tree
                    self.to_proxy(msg.Rescore(len(self.executions) - 1, m.id, cg.task, cg.instance))
                elif m.state == "open":  # no model call yet: its reward would say nothing
                    self._close_unrecoverable(len(self.executions) - 1,
                                              "the job died before it made a model call")  # fmt: skip
                elif m.state == "unlaunched":
                    self._record_not_launched(len(self.executions) - 1, "the job died first")
        while self.recovering:
            self.handle(self.wait_for(msg.Assessed, self.cfg.timeouts.drain_s))
        for cg, g in zip(self.takeover.groups, range(len(self.groups))):
            members = self.executions[g * self.n : (g + 1) * self.n]
            if any(x.verdict is not None and x.verdict.usable for x in members):
                carried.append(cg)
            else:
                dropped.append(cg.id)
        self._keep_only(carried)
        self.rec.event("resumed", version=self.sched.version, updates=self.updates,
                       carried=[c.id for c in carried], dropped=dropped,
                       repaired=self.rec.writer.repaired, seconds=time.time() - t0)  # fmt: skip
        self.carried = len(carried)
        return tuple(c.version for c in carried)

    def _keep_only(self, carried: list[recovery.CarriedGroup]) -> None:
        """Renumber: the carried groups become scheduler groups 0..c-1 (dropped ones leave)."""
        keep = {c.id for c in carried}
        groups: list[Group] = []
        executions: list[Execution] = []
        for g, group in enumerate(self.groups):
            if group.id in keep:
                for x in self.executions[g * self.n : (g + 1) * self.n]:
                    x.group = len(groups)
                    executions.append(x)
                groups.append(group)
        self.groups, self.executions = groups, executions

    def to_proxy(self, m: msg.Message) -> None:
        self.link.send(m, PROXY_RANK)

    def to_rank(self, rank: int, m: msg.Message) -> None:
        self.link.send(m, rank)

    def to_cell(self, cell: int, m: msg.Message) -> None:
        """A training message to every rank of `cell` (each takes its share; the leader answers)."""
        for rank in self.cell_members[cell]:
            self.link.send(m, rank)

    # ------------------------------------------------------------------ scheduler driving

    def feed(self, event: ev.Event) -> None:
        """Hand one event to the scheduler and carry out its actions (re-entrant)."""
        self.pending.append(event)
        if len(self.pending) > 1:
            return
        while self.pending:
            for action in self.sched.handle(self.pending[0]):
                ACTIONS[type(action)](self, action)
            self.pending.popleft()
            self._flush_drains()
            self.rec.set_roles(list(self.sched.roles))

    def _flush_drains(self) -> None:
        for c, routes in self.drain_routes.items():
            # a lost engine's drain only moves calls; a switching cell's is acknowledged
            self.to_proxy(msg.Drain(str(EngineId(c)), routes, ack=c in self.switching_to_train))
            self.switching_to_train.discard(c)
        self.drain_routes = {}

    def dispatch(self, a: ev.Dispatch) -> None:
        g = len(self.groups)
        assert g == a.group, f"groups dispatched out of order: {a.group} after {g - 1}"
        number = self.first_new_group + a.group - self.carried  # unique across resumes
        task = self.task_names[number % len(self.task_names)]
        group = Group(id=f"g{number}", task=task, version=a.version,
                      instance=instance_seed(self.cfg.train.seed, number))  # fmt: skip
        self.groups.append(group)
        for x in a.executions:
            self.executions.append(Execution(id=f"{group.id}-e{x - a.group * self.n}", group=g))
        ids = [self.executions[x].id for x in a.executions]
        self.rec.groups(group.id, f"{task}@{group.instance}", ids, a.version)
        self.rec.dispatch(a.version, 1, len(a.executions), self.sched)

    def launch(self, a: ev.Launch) -> None:
        if self.finishing:
            return
        x = self.executions[a.execution]
        g = self.groups[x.group]
        x.state = "running"
        engine = str(EngineId(a.engine))
        self.rec.open_execution(x.id, {"group": g.id, "task": g.task, "instance": g.instance,
                                       "engine": engine})  # fmt: skip
        self.to_proxy(msg.StartExecution(execution=a.execution, execution_id=x.id, task=g.task,
                                         instance=g.instance, engine=engine))  # fmt: skip

    def switch(self, a: ev.SwitchCell) -> None:
        self.stats["switches"] += 1
        self.switch_started[a.cell] = time.time()
        if a.role is Role.TRAIN:
            self.drain_routes.setdefault(a.cell, {})  # sent once the reroutes are known
            self.switching_to_train.add(a.cell)  # its Drained answer sends ToTrain
        else:
            self.to_rank(self.engine_ranks[a.cell], msg.ToRollout(self.sched.published))

    def reroute(self, a: ev.Reroute) -> None:
        self.stats["reroutes"] += 1
        eid = self.executions[a.execution].id
        self.drain_routes.setdefault(a.source, {})[eid] = str(EngineId(a.destination))
        # its KV follows it (docs/engine.md "KV-cache migration"), unless it died with the engine
        if a.destination in self.urls and a.source not in self.respawning:
            self.kv_routes.setdefault(a.source, {})[eid] = self.urls[a.destination]
        self.rec.event("reroute", execution=eid, source=a.source, destination=a.destination)

    def open_window(self, a: ev.OpenJoinWindow) -> None:
        self.train.begin(a.batch, self.sched.version)
        self.batch_t0 = time.time()
        self.rec.event("join_window", batch=a.batch, open=True)

    def close_window(self, a: ev.CloseJoinWindow) -> None:
        self.rec.event("join_window", batch=a.batch, open=False)

    def admit(self, a: ev.AdmitGroup) -> None:
        g = self.groups[a.group]
        members = self.executions[a.group * self.n : (a.group + 1) * self.n]
        outcomes = []
        for x in members:
            assert x.verdict is not None
            outcomes.append(ExecutionOutcome(execution_id=x.id, reward=x.verdict.reward,
                                             status=Status.of(x.verdict.status)))  # fmt: skip
        trees = {x.id: x.tree for x in members if x.tree is not None}
        for x in members:
            x.tree = None  # the packing buffer holds it now
        self.rec.event("admit", group=g.id, batch=a.batch, staleness=a.staleness)
        self.batch_groups.setdefault(a.batch, []).append(g.id)
        count = self.train.admit(g.id, g.version, a.staleness, outcomes, trees)
        for group in self.train.new_set_aside:  # too few usable outcomes (docs/training.md)
            self.rec.event("set_aside", group=group, batch=a.batch)
        self.feed(ev.MicroStepsQueued(batch=a.batch, group=a.group, count=count))

    def _why_untrainable(self) -> str:
        """The executions so far by outcome, and why the first failed harness failed."""
        counts: dict[str, int] = {}
        for x in self.executions:
            if x.verdict is not None:
                key = f"{x.outcome}/{x.verdict.status.value}"
                counts[key] = counts.get(key, 0) + 1
        text = "executions so far (harness outcome/verdict): " + ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items())
        )
        failed = next((x for x in self.executions if x.outcome == Outcome.FAILED.value), None)
        if failed is not None:  # the runner's reason carries the harness's stderr tail
            text += f"; {failed.id}'s harness failed: {failed.reason or '(no reason given)'}"
        return text

    def claim(self, a: ev.ClaimMicroStep) -> None:
        self.train.claim(a.cell, a.work)

    def update(self, a: ev.OptimizerUpdate) -> None:
        self.train.update(a.cells)

    def publish(self, a: ev.Publish) -> None:
        targets = [(e, self.urls[e]) for e in a.engines]
        self.to_rank(self.engine_ranks[0], msg.Publish(version=a.version, targets=targets))

    # ------------------------------------------------------------------ messages

    def handle(self, m: msg.Message) -> None:
        MESSAGES[type(m)](self, m)

    def on_drained(self, m: msg.Drained) -> None:
        c = EngineId.parse(m.engine).index
        self.to_rank(self.engine_ranks[c], msg.ToTrain(routes=self.kv_routes.pop(c, {})))

    def on_switched(self, m: msg.Switched) -> None:
        """The cell is in its new role; the whole transition (drain and reroute included,
        the time the cell served neither role) is what the scheduler learns from."""
        total = time.time() - self.switch_started.pop(m.cell, time.time())
        self.switch_seconds.append(total)
        self.rec.event("switch", cell=m.cell, to=m.role.value, seconds=total,
                       cell_seconds=m.seconds, **m.detail)  # fmt: skip
        if m.role is Role.ROLLOUT:
            self.to_proxy(msg.Undrain(str(EngineId(m.cell))))
        if m.cell in self.fixed_train:
            self.fixed_train.discard(m.cell)
            return
        self.feed(ev.SwitchDone(m.cell, seconds=total))

    def on_harness_ended(self, m: msg.HarnessEnded) -> None:
        x = self.executions[m.execution]
        x.state, x.outcome, x.reason = "terminated", m.outcome.value, m.reason
        if m.outcome not in (Outcome.COMPLETED, Outcome.CANCELLED):
            self.rec.event("terminated", execution=x.id, outcome=m.outcome.value, reason=m.reason)
        if not self.finishing:
            self.feed(ev.Terminated(m.execution, m.outcome))

    def on_journal_node(self, m: msg.JournalNode) -> None:
        self.rec.journal(m.execution_id, m.node)

    def on_assessed(self, m: msg.Assessed) -> None:
        self.stats["harness_errors"] += m.errors
        x = self.executions[m.execution]
        g = self.groups[x.group]
        recovered = self.recovering.pop(m.execution, None)
        tree = recovered if recovered is not None else self.rec.journaled_tree(x.id)
        status = x.outcome if x.state == "terminated" else "failed"
        self.rec.close_execution(x.id, g.id, tree, status, m.verdict)
        if m.verdict.status is VerdictStatus.EXCLUDED:
            self.rec.event("excluded", execution=x.id, error=m.verdict.error)
        x.state, x.verdict = "recorded", m.verdict
        if m.verdict.status is VerdictStatus.SCORED:
            x.tree = tree
        if recovered is not None:
            return  # a resumed run's takeover: the scheduler has not started yet
        g.assessed += 1
        if g.assessed == self.n and not self.finishing:
            self.feed(ev.GroupReady(x.group))

    def on_prepassed(self, m: msg.Prepassed) -> None:
        if self.finishing:
            return
        ready = self.train.prepassed(m)
        self.feed(ev.MicroStepDone(cell=m.cell, batch=m.batch, seconds=m.seconds))
        if ready:
            self.feed(ev.GradientsReady(batch=m.batch, count=ready))

    def on_accumulated(self, m: msg.Accumulated) -> None:
        if self.finishing:
            return
        self.train.accumulated(m)
        self.feed(ev.MicroStepDone(cell=m.cell, batch=m.batch, seconds=m.seconds))

    def on_updated(self, m: msg.Updated) -> None:
        if not self.train.updated(m):
            return
        self.updates += 1
        self.trained += self.batch_groups.pop(m.batch, [])
        self._record_step()
        if self.updates >= self.cfg.steps:
            self.finishing = True  # nothing new starts: no satellite return, no publication
            return
        self.feed(ev.BatchDone(m.batch))
        if self._checkpoint_due():
            self.start_checkpoint()

    def _checkpoint_due(self) -> bool:
        c = self.cfg.checkpoint
        if self.checkpoint_folder is not None:
            return False  # one at a time
        by_steps = c.every_steps > 0 and self.updates % c.every_steps == 0
        by_time = c.every_minutes > 0 and time.time() - self.last_checkpoint >= 60 * c.every_minutes
        return by_steps or by_time

    def start_checkpoint(self) -> None:
        """The core saves its weights and optimizer now; `on_checkpointed` commits the rest.

        The core handles messages in order, so it saves the weights of the update just made
        (nothing can update them before it reads this); the groups those weights trained
        are noted now, with them.
        """
        folder = checkpoint.begin(self.run_dir, self.sched.version)
        self.checkpoint_folder = (folder, list(self.trained))
        self.to_rank(self.engine_ranks[0], msg.SaveCheckpoint(str(folder)))

    def _record_step(self) -> None:
        row = {
            **self.train.metrics(),
            "train_cells": float(len(self.sched.training_cells())),
            "duration_s": time.time() - self.batch_t0,
            "elapsed_s": time.time() - self.t0,
        }
        self.step_rows.append(row)
        self.rec.step(self.updates, row)
        self.tracker.log_step(self.updates, row)
        self.rec.dispatch(self.sched.version, 0, 0, self.sched)
        self.stats["set_aside_groups"] += int(row["set_aside_groups"])
        if row["executions"] == 0:
            self._empty_step(row)
            return
        self.empty_in_a_row = 0
        if not row["grad_norm"] > 0:
            self.stats["no_signal_steps"] += 1
            why = ("every group's rewards tie" if row["tied_groups"] == 1.0
                   else "every execution was clipped or has advantage 0")  # fmt: skip
            self.rec.event("no_signal", step=self.updates, reason=why)
            print(f"GYRE-WARNING step {self.updates} carried no learning signal "
                  f"(grad_norm {row['grad_norm']:.3g}): {why}", flush=True)  # fmt: skip

    def _empty_step(self, row: dict[str, float]) -> None:
        """A batch with nothing to train skipped its update; too many in a row stop the run."""
        self.stats["empty_steps"] += 1
        self.empty_in_a_row += 1
        why = (f"{row['set_aside_groups']:.0f} of its groups set aside "
               f"(fewer than train.min_group_outcomes={self.cfg.train.min_group_outcomes} "
               "usable outcomes), the rest only failure placeholders")  # fmt: skip
        self.rec.event("empty_step", step=self.updates, reason=why)
        print(f"GYRE-WARNING step {self.updates} had nothing to train and skipped its update: "
              f"{why}", flush=True)  # fmt: skip
        if self.empty_in_a_row >= self.cfg.train.max_empty_batches:
            raise wire.RuntimeFailure(
                f"{self.empty_in_a_row} batches in a row had nothing to train "
                f"(train.max_empty_batches): {self._why_untrainable()}"
            )

    def on_published(self, m: msg.Published) -> None:
        self.stats["publications"] += 1
        self.rec.event("publish", version=m.version, seconds=m.seconds, missed=m.missed)
        self.feed(ev.WeightsPublished(m.version))
        for engine in m.missed:  # died around the publication, or restarted before it
            self.to_rank(self.engine_ranks[engine], msg.Reload())

    def on_policy_saved(self, m: msg.PolicySaved) -> None:
        self.policies.append(m.path)
        self.rec.event("policy", version=m.version, path=m.path)

    def on_engine_lost(self, m: msg.EngineLost) -> None:
        """A killed engine: drain it (its calls retry elsewhere), restart it, record the loss."""
        self.stats["engine_losses"] += 1
        self.rec.event("engine_lost", engine=m.engine, returncode=m.returncode)
        self.respawning.add(m.engine)
        self.kv_routes.pop(m.engine, None)  # its KV died with it
        # The scheduler stops placing on it and moves its executions where there is room;
        # the Drain carrying those routes (ack-less: no role change) is sent by feed().
        self.drain_routes.setdefault(m.engine, {})
        self.feed(ev.EngineLost(m.engine))
        role = self.sched.roles[m.engine] if m.engine < self.k else Role.ROLLOUT
        self.to_rank(self.engine_ranks[m.engine], msg.Respawn(role))

    def on_engine_ready(self, m: msg.EngineReady) -> None:
        self.respawning.discard(m.engine)
        self.urls[m.engine] = m.url
        if m.version < self.sched.published:  # restarted from an older copy than served now
            self.to_rank(self.engine_ranks[m.engine], msg.Reload())
        self.rec.event("engine_restarted", engine=m.engine)
        self.to_proxy(msg.SetEngines({str(EngineId(m.engine)): m.url}))
        if m.engine < self.k and self.sched.roles[m.engine] is not Role.ROLLOUT:
            self.to_proxy(msg.Drain(str(EngineId(m.engine)), {}, ack=False))
        self.feed(ev.EngineRestored(m.engine))

    def on_checkpointed(self, m: msg.Checkpointed) -> None:
        """Commit the checkpoint the core just saved (its driver state; rename; prune)."""
        assert self.checkpoint_folder is not None and str(self.checkpoint_folder[0]) == m.folder
        folder, trained = self.checkpoint_folder
        state = {"version": m.version, "updates": self.updates_at(m.version), "trained": trained,
                 "next_group": self.first_new_group + len(self.groups) - self.carried,
                 "t": time.time()}  # fmt: skip
        final = checkpoint.commit(self.run_dir, folder, state, self.cfg.checkpoint.keep)
        self.checkpoint_folder, self.last_checkpoint = None, time.time()
        self.rec.event("checkpoint", version=m.version, path=str(final), bytes=m.bytes,
                       seconds=m.seconds)  # fmt: skip

    def updates_at(self, version: int) -> int:
        """Updates done when the weights had `version` (a resumed run started mid-count)."""
        return self.updates - (self.sched.version - version)

    # ------------------------------------------------------------------ end of run

    def wait_for(self, kind: type[msg.Message], timeout: float) -> msg.Message:
        """Handle executions' reports until a `kind` message arrives; returns it."""
        deadline = time.time() + timeout
        while True:
            m = self.next_message(max(0.1, deadline - time.time()))
            if isinstance(m, kind):
                return m
            if isinstance(m, msg.HarnessEnded | msg.Assessed | msg.JournalNode | msg.EngineReady
                          | msg.PolicySaved):  # fmt: skip
                self.handle(m)
            if time.time() > deadline:
                raise wire.RuntimeFailure(f"no {kind.__name__} within {timeout:.0f}s")

    def checkpoint(self) -> dict[str, Any]:
        """SIGUSR1: record what runs, checkpoint, stop with EXIT_CHECKPOINTED (requeue)."""
        self.rec.event("preempted", step=self.updates)
        self.finishing = True
        if self.checkpoint_folder is None:
            self.start_checkpoint()
        while self.checkpoint_folder is not None:
            self.handle(self.wait_for(msg.Checkpointed, self.cfg.timeouts.drain_s))
        self.status = checkpoint.EXIT_CHECKPOINTED
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """Cancel running harnesses, record every execution, save the policy, stop all ranks."""
        self.finishing = True
        self.to_proxy(msg.Cancel([x.id for x in self.executions if x.live]))
        deadline = time.time() + self.cfg.timeouts.drain_s
        while any(x.live for x in self.executions) and time.time() < deadline:
            m = self.next_message(max(0.1, deadline - time.time()))
            if isinstance(m, msg.HarnessEnded | msg.Assessed | msg.JournalNode | msg.PolicySaved
                          | msg.Checkpointed):  # fmt: skip
                self.handle(m)
        # never stop a cell in the middle of restarting its engine: let the restart finish
        deadline = time.time() + self.cfg.timeouts.startup_s
        while self.respawning and time.time() < deadline:
            m = self.next_message(max(0.1, deadline - time.time()))
            if isinstance(m, msg.EngineReady):
                self.handle(m)
        if self.status == 0:
            self.to_rank(self.engine_ranks[0], msg.SavePolicy("final"))
            saved = self.wait_for(msg.PolicySaved, self.cfg.timeouts.drain_s)
            self.handle(saved)
        for i, x in enumerate(self.executions):
            if x.state == "queued":
                self._record_not_launched(i)
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

    def _close_unrecoverable(self, i: int, why: str) -> None:
        """An execution a dead job left open that cannot be scored: excluded, with the reason."""
        x = self.executions[i]
        verdict = msg.VerdictRecord.excluded(f"unrecoverable: {why}", time.time())
        self.rec.close_execution(x.id, self.groups[x.group].id, self.rec.journaled_tree(x.id),
                                 "unrecoverable", verdict)  # fmt: skip
        x.state, x.outcome, x.verdict = "recorded", "unrecoverable", verdict

    def _record_not_launched(self, i: int, why: str = "the run ended first") -> None:
        from gyre.trajectory.tree import TrajectoryTree

        x = self.executions[i]
        g = self.groups[x.group]
        self.rec.open_execution(x.id, {"group": g.id, "task": g.task, "instance": g.instance})
        verdict = msg.VerdictRecord.excluded(f"dispatched, never launched: {why}", time.time())
        self.rec.close_execution(x.id, g.id, TrajectoryTree(x.id), "not_launched", verdict)
        x.state, x.outcome, x.verdict = "recorded", "not_launched", verdict

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "policy": self.cfg.schedule.policy,
            "ranks_per_cell": self.cfg.topology.ranks_per_cell,
            "cell_hosts": [[self.hosts[r] for r in members] for members in self.cell_members]
            if self.hosts
            else None,
            "status": self.status,
            "resumed_from": None
            if self.resumed is None
            else {k: self.resumed[k] for k in ("version", "updates")},
            "steps_done": self.updates,
            "wall_s": time.time() - self.t0,
            "executions": len(self.executions),
            "switch_s_mean": sum(self.switch_seconds) / max(1, len(self.switch_seconds)),
            "wasted_switches": self.sched.wasted_switches,
            **self.stats,
            "policies": self.policies,
            "steps": self.step_rows,
        }

    def progress(self) -> None:
        """One JSON progress line on stdout (rendered live by `gyre run`), at most 2 per s."""
        now = time.time()
        if now - self.last_progress < 0.5:
            return
        self.last_progress = now
        last = self.step_rows[-1] if self.step_rows else {}
        line = {
            "t": now - self.t0, "step": self.updates, "steps": self.cfg.steps,
            "waterlevel": self.sched.waterlevel, "roles": [r.value for r in self.sched.roles],
            "version": self.sched.version, "published": self.sched.published,
            "reward": last.get("reward_mean"), "staleness": last.get("staleness_mean"),
            "loss": last.get("loss"), "grad_norm": last.get("grad_norm"),
            "tied_groups": last.get("tied_groups"), **self.stats,
        }  # fmt: skip
        print("GYRE-PROGRESS " + json.dumps(line), flush=True)


ACTIONS: dict[type, Callable[[Coordinator, Any], None]] = {
    ev.Dispatch: Coordinator.dispatch,
    ev.Launch: Coordinator.launch,
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
    msg.Drained: Coordinator.on_drained,
    msg.Switched: Coordinator.on_switched,
    msg.HarnessEnded: Coordinator.on_harness_ended,
    msg.JournalNode: Coordinator.on_journal_node,
    msg.Assessed: Coordinator.on_assessed,
    msg.Prepassed: Coordinator.on_prepassed,
    msg.Accumulated: Coordinator.on_accumulated,
    msg.Updated: Coordinator.on_updated,
    msg.Published: Coordinator.on_published,
    msg.PolicySaved: Coordinator.on_policy_saved,
    msg.EngineLost: Coordinator.on_engine_lost,
    msg.EngineReady: Coordinator.on_engine_ready,
    msg.Checkpointed: Coordinator.on_checkpointed,
}
