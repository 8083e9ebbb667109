"""The coordinator (world rank 0): drives the pure scheduler with real processes.

The loop reads top to bottom: take the next message from the proxy node or a cell, turn it
into a scheduler event, and carry out the actions the scheduler returns —

    dispatch  -> record the group, pick its task
    launch    -> the proxy node starts the harness, routed to the named engine
    switch    -> to TRAIN: the proxy drains the source and reroutes its executions, acks,
                 then the cell aborts its calls and releases its engine; to ROLLOUT: the
                 cell resumes its engine, then the proxy routes to it again
    close     -> a terminated execution's tree goes into the trace
    score     -> its verdict completes the group; a complete group is ready
    admit     -> the packing buffer takes the ready group; cells claim micro-steps
    train     -> phase B on the training prefix, one core update
    publish   -> the core pushes weights to every rollout engine

— exactly as `gyre.sim.Simulator` does with simulated durations. Every wait is bounded
(`timeouts.stall_s`); the run ends after `steps` updates: running harnesses are cancelled,
scored and recorded, and every rank is told to stop.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.runtime import checkpoint, wire
from gyre.runtime.config import RunConfig
from gyre.runtime.layout import PROXY_RANK
from gyre.runtime.record import RunRecorder
from gyre.runtime.training import TrainingDriver
from gyre.schedule import Scheduler, make_policy
from gyre.schedule import events as ev
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.train.stream import EmptyBatchError

OUTCOMES = {
    "completed": ev.Outcome.COMPLETED,
    "failed": ev.Outcome.FAILED,
    "timed_out": ev.Outcome.HARNESS_TIMEOUT,
    "cancelled": ev.Outcome.CANCELLED,
}
VERDICT_STATUS = {"scored": Status.VALID, "placeholder": Status.PLACEHOLDER,
                  "excluded": Status.EXCLUDED}  # fmt: skip


class Coordinator:
    """Scheduler + trace + training book-keeping, talking MPI to every other rank."""

    def __init__(
        self, cfg: RunConfig, comm: Any, run_dir: Path, engine_ranks: list[int], meta: dict
    ) -> None:
        self.cfg, self.comm, self.run_dir = cfg, comm, run_dir
        self.engine_ranks = engine_ranks
        sc, pc = cfg.schedule.scheduler(cfg.topology)
        self.sched = Scheduler(sc, make_policy(sc, pc))
        self.n = sc.group_size
        self.k = sc.cells
        from gyre.runtime.proxy_node import load_tasks

        _, self.task_names = load_tasks(cfg)
        self.resumed = checkpoint.load_state(run_dir)
        trace = checkpoint.trace_path(run_dir)
        # a resumed segment names its groups r<n>-g<i>: ids (and workspaces) stay unique
        self.prefix = "" if trace.name == "trace.h5" else f"r{trace.name.split('.')[1]}-"
        self.rec = RunRecorder(trace, meta, self.k)
        self.train = TrainingDriver(
            groups_per_batch=sc.batch_groups, group_size=sc.group_size,
            token_budget=cfg.train.token_budget, j_max=cfg.train.j_max, seed=cfg.train.seed,
        )  # fmt: skip
        self.pending: deque[ev.Event] = deque()
        self.urls: dict[int, str] = {}
        self.drain_routes: dict[int, dict[str, str]] = {}
        self.fixed_train: set[int] = set()
        self.eid: list[str] = []
        self.group_task: list[str] = []
        self.group_version: list[int] = []
        self.state: dict[int, str] = {}  # x -> queued | running | terminated | recorded
        self.respawning: set[int] = set()  # engines lost and not yet back
        self.harness_reason: dict[int, str] = {}  # why a harness did not complete
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.harness_outcome: dict[int, str] = {}
        self.trees: dict[int, Any] = {}
        self.assessed_in_group: dict[int, int] = {}
        self.updates = 0
        if self.resumed is not None:  # continue from the checkpoint's policy version
            self.updates = int(self.resumed["updates"])
            self.sched.version = self.sched.published = int(self.resumed["version"])
        self.status = 0
        self.updaters: set[int] = set()
        self.batch_t0 = time.time()
        self.stats = {"reroutes": 0, "switches": 0, "harness_errors": 0, "engine_losses": 0,
                      "publications": 0}  # fmt: skip
        self.switch_seconds: list[float] = []
        self.step_rows: list[dict[str, float]] = []
        self.last_progress = 0.0
        self.t0 = time.time()
        self.finishing = False
        self.last_message = time.monotonic()

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict[str, Any]:
        """Start, loop until `steps` updates, finish; returns the summary."""
        self.startup()
        self.feed(ev.Start())
        deadline = self.t0 + self.cfg.timeouts.run_s
        while self.updates < self.cfg.steps:
            if checkpoint.PREEMPT.is_set():
                return self.checkpoint()
            self.handle(self.next_message(min(1.0, self.cfg.timeouts.stall_s), stall_ok=True))
            self.progress()
            if time.time() > deadline:
                raise wire.RuntimeFailure(f"run exceeded timeouts.run_s={self.cfg.timeouts.run_s}")
        return self.finish()

    def next_message(self, timeout: float | None = None, stall_ok: bool = False) -> tuple:
        """The next message; `("idle",)` after `timeout` when `stall_ok` and not stalled."""
        wait = self.cfg.timeouts.stall_s if timeout is None else timeout
        msg = wire.poll(self.comm, None, wire.UP, timeout=wait)
        if msg is not None:
            self.last_message = time.monotonic()
            return msg
        if stall_ok and time.monotonic() - self.last_message < self.cfg.timeouts.stall_s:
            return ("idle",)
        if msg is None:
            raise wire.RuntimeFailure(
                f"no progress for {wait:.0f}s (step {self.updates}, waterlevel "
                f"{self.sched.waterlevel}, phase {self.sched.phase.value}, roles "
                f"{[r.value for r in self.sched.roles]}); see the logs in {self.run_dir}"
            )
        return msg

    def startup(self) -> None:
        """Wait for the proxy and every engine, tell the proxy the engines."""
        needed = {"proxy"} | {f"engine{e}" for e in range(len(self.engine_ranks))}
        while needed:
            msg = self.next_message(self.cfg.timeouts.startup_s)
            if msg[0] == "proxy_ready":
                needed.discard("proxy")
                self.proxy_url = msg[1]
            elif msg[0] == "engine_ready":
                needed.discard(f"engine{msg[1]}")
                self.urls[msg[1]] = msg[2]
            else:
                raise wire.RuntimeFailure(f"unexpected message at startup: {msg[0]!r}")
        self.to_proxy(("engines", {_engine_id(e): u for e, u in self.urls.items()}))
        for c, role in enumerate(self.sched.roles):  # Async: cells fixed in training
            if role is ev.Role.TRAIN:
                self.fixed_train.add(c)  # not a scheduler switch: no SwitchDone
                self.to_proxy(("drain", _engine_id(c), {}, False))
                self.to_rank(self.engine_ranks[c], ("to_train", 0))
        self.rec.set_roles([r.value for r in self.sched.roles])
        self.rec.event("started", seconds=time.time() - self.t0, proxy=self.proxy_url)

    def gid(self, group: int) -> str:
        return f"{self.prefix}g{group}"

    def to_proxy(self, msg: tuple) -> None:
        wire.send(self.comm, msg, PROXY_RANK, wire.DOWN)

    def to_rank(self, rank: int, msg: tuple) -> None:
        wire.send(self.comm, msg, rank, wire.DOWN)

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
            self.rec.set_roles([r.value for r in self.sched.roles])

    def _flush_drains(self) -> None:
        for c, routes in self.drain_routes.items():
            self.to_proxy(("drain", _engine_id(c), routes, True))
        self.drain_routes = {}

    def dispatch(self, a: ev.Dispatch) -> None:
        task = self.task_names[a.group % len(self.task_names)]
        self.group_task.append(task)
        self.group_version.append(a.version)
        for x in a.executions:
            self.eid.append(f"{self.gid(a.group)}-e{x - a.group * self.n}")
            self.state[x] = "queued"
        self.rec.groups(self.gid(a.group), task, [self.eid[x] for x in a.executions], a.version)
        self.rec.dispatch(a.version, 1, len(a.executions), self.sched)

    def launch(self, a: ev.Launch) -> None:
        x = a.execution
        if self.finishing:
            return
        g = x // self.n
        self.state[x] = "running"
        self.rec.open_execution(self.eid[x], {"group": self.gid(g), "task": self.group_task[g],
                                              "engine": _engine_id(a.engine)})  # fmt: skip
        self.to_proxy(("launch", x, self.eid[x], self.group_task[g], _engine_id(a.engine)))

    def switch(self, a: ev.SwitchCell) -> None:
        self.stats["switches"] += 1
        if a.role is ev.Role.TRAIN:
            self.drain_routes.setdefault(a.cell, {})  # sent once the reroutes are known
        else:
            self.to_rank(self.engine_ranks[a.cell], ("to_rollout", self.sched.published))

    def reroute(self, a: ev.Reroute) -> None:
        self.stats["reroutes"] += 1
        dest = _engine_id(a.destination)
        self.drain_routes.setdefault(a.source, {})[self.eid[a.execution]] = dest
        self.rec.event("reroute", execution=self.eid[a.execution], source=a.source,
                       destination=a.destination)  # fmt: skip

    def open_window(self, a: ev.OpenJoinWindow) -> None:
        self.train.begin(a.batch)
        self.batch_t0 = time.time()
        self.rec.event("join_window", batch=a.batch, open=True)

    def close_window(self, a: ev.CloseJoinWindow) -> None:
        self.rec.event("join_window", batch=a.batch, open=False)

    def admit(self, a: ev.AdmitGroup) -> None:
        xs = range(a.group * self.n, (a.group + 1) * self.n)
        outcomes = [
            ExecutionOutcome(execution_id=self.eid[x], status=VERDICT_STATUS[v["status"]],
                             reward=v["reward"])
            for x in xs for v in [self.outcomes[x]]
        ]  # fmt: skip
        trees = {self.eid[x]: self.trees.pop(x) for x in xs if x in self.trees}
        try:
            count = self.train.admit(self.gid(a.group), self.group_version[a.group],
                                     a.staleness, outcomes, trees)  # fmt: skip
        except EmptyBatchError as exc:
            raise wire.RuntimeFailure(f"{exc}: {self._why_untrainable()}") from exc
        self.feed(ev.MicroStepsQueued(batch=a.batch, group=a.group, count=count))

    def _why_untrainable(self) -> str:
        """The executions so far by outcome, and why the first failed harness failed."""
        counts: dict[str, int] = {}
        first_failed = None
        for x, verdict in self.outcomes.items():
            outcome = self.harness_outcome.get(x, "not_launched")
            key = f"{outcome}/{verdict['status']}"
            counts[key] = counts.get(key, 0) + 1
            if outcome == "failed" and first_failed is None:
                first_failed = x
        text = "executions so far (harness outcome/verdict): " + ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items())
        )
        if first_failed is not None:  # the runner's reason carries the harness's stderr tail
            why = self.harness_reason.get(first_failed, "(no reason given)")
            text += f"; {self.eid[first_failed]}'s harness failed: {why}"
        return text

    def claim(self, a: ev.ClaimMicroStep) -> None:
        self.to_rank(self.engine_ranks[a.cell], ("prepass", a.batch, self.train.claim()))

    def update(self, a: ev.OptimizerUpdate) -> None:
        cells = a.cells
        if cells != tuple(range(len(cells))):
            raise wire.RuntimeFailure(f"training cells {cells} are not a prefix 0..m-1")
        share, scalars, num_exec = self.train.assignments(cells)
        self.updaters = set(cells)
        self.update_info: dict[str, float] = {"objective": 0.0, "targets": 0.0}
        for c in cells:
            self.to_rank(self.engine_ranks[c],
                         ("train", a.batch, share[c], scalars, num_exec, len(cells)))  # fmt: skip

    def publish(self, a: ev.Publish) -> None:
        targets = [(e, self.urls[e]) for e in a.engines]
        self.to_rank(self.engine_ranks[0], ("publish", a.version, targets))

    # ------------------------------------------------------------------ messages

    def handle(self, msg: tuple) -> None:
        if msg[0] != "idle":
            MESSAGES[msg[0]](self, *msg[1:])

    def on_drained(self, engine_id: str) -> None:
        c = int(engine_id[1:])
        self.to_rank(self.engine_ranks[c], ("to_train", self.sched.version))

    def on_switched(self, cell: int, role: str, seconds: float) -> None:
        self.switch_seconds.append(seconds)
        self.rec.event("switch", cell=cell, to=role, seconds=seconds)
        if role == "rollout":
            self.to_proxy(("undrain", _engine_id(cell)))
        if cell in self.fixed_train:
            self.fixed_train.discard(cell)
            return
        self.feed(ev.SwitchDone(cell))

    def on_terminated(self, x: int, outcome: str, t_launch: Any, t_end: float, reason: str) -> None:
        self.state[x] = "terminated"
        self.harness_outcome[x] = outcome
        if reason:
            self.harness_reason[x] = reason
        if outcome not in ("completed", "cancelled"):
            self.rec.event("terminated", execution=self.eid[x], outcome=outcome, reason=reason)
        if not self.finishing:
            self.feed(ev.Terminated(x, OUTCOMES[outcome]))

    def on_assessed(self, x: int, tree: Any, verdict: dict[str, Any], errors: int) -> None:
        self.stats["harness_errors"] += errors
        g = x // self.n
        status = self.harness_outcome.get(x, "failed")
        self.rec.close_execution(self.eid[x], self.gid(g), tree, status, verdict)
        if verdict["status"] == "excluded":
            self.rec.event("excluded", execution=self.eid[x], error=verdict.get("error", ""))
        self.state[x] = "recorded"
        self.outcomes[x] = verdict
        if verdict["status"] == "scored":
            self.trees[x] = tree
        self.assessed_in_group[g] = self.assessed_in_group.get(g, 0) + 1
        if self.assessed_in_group[g] == self.n and not self.finishing:
            self.feed(ev.GroupReady(g))

    def on_prepassed(self, cell: int, batch: int, index: int, sums: dict) -> None:
        if self.finishing:
            return
        self.train.prepassed(index, sums)
        self.feed(ev.MicroStepDone(cell=cell, batch=batch))

    def on_updated(self, cell: int, batch: int, objective: float, targets: int,
                   seconds: float, info: dict) -> None:  # fmt: skip
        self.update_info["objective"] += objective
        self.update_info["targets"] += targets
        self.update_info.update(info)
        self.updaters.discard(cell)
        if self.updaters:
            return
        self.updates += 1
        self._record_step(batch)
        if self.updates >= self.cfg.steps:
            self.finishing = True  # nothing new starts: no satellite return, no publication
            return
        self.feed(ev.BatchDone(batch))

    def _record_step(self, batch: int) -> None:
        t = self.train
        rewards = t.rewards or [float("nan")]
        row = {
            "loss": -self.update_info["objective"] / max(1.0, self.update_info["targets"]),
            "objective": self.update_info["objective"],
            "targets": self.update_info["targets"],
            "grad_norm": self.update_info.get("grad_norm", float("nan")),
            "reward_mean": sum(rewards) / len(rewards),
            "staleness_mean": sum(t.staleness) / max(1, len(t.staleness)),
            "staleness_max": max(t.staleness, default=0),
            "microsteps": len(t.steps),
            "train_cells": len(self.sched.training_cells()),
            "duration_s": time.time() - self.batch_t0,
            "elapsed_s": time.time() - self.t0,
        }
        self.step_rows.append(row)
        self.rec.step(self.updates, row)
        self.rec.dispatch(self.sched.version, 0, 0, self.sched)

    def on_published(self, version: int, seconds: float, missed: list[int]) -> None:
        self.stats["publications"] += 1
        self.rec.event("publish", version=version, seconds=seconds, missed=missed)
        self.feed(ev.WeightsPublished(version))
        for engine in missed:  # died around the publication, or restarted before it
            self.to_rank(self.engine_ranks[engine], ("reload",))

    def on_engine_lost(self, engine: int, returncode: int) -> None:
        """A killed engine: drain it (its calls retry elsewhere), restart it, record the loss."""
        self.stats["engine_losses"] += 1
        self.rec.event("engine_lost", engine=engine, returncode=returncode)
        self.to_proxy(("drain", _engine_id(engine), {}, False))
        role = self.sched.roles[engine].value if engine < self.k else "rollout"
        self.respawning.add(engine)
        self.to_rank(self.engine_ranks[engine], ("respawn", role))

    def on_engine_ready(self, engine: int, url: str, version: int) -> None:
        self.respawning.discard(engine)
        self.urls[engine] = url
        if version < self.sched.published:  # restarted from an older copy than served now
            self.to_rank(self.engine_ranks[engine], ("reload",))
        self.rec.event("engine_restarted", engine=engine)
        self.to_proxy(("engines", {_engine_id(engine): url}))
        if engine < self.k and self.sched.roles[engine] is not ev.Role.ROLLOUT:
            self.to_proxy(("drain", _engine_id(engine), {}, False))

    # ------------------------------------------------------------------ end of run

    def checkpoint(self) -> dict[str, Any]:
        """SIGUSR1: record what runs, save core + driver state, stop with EXIT_CHECKPOINTED."""
        self.rec.event("preempted", step=self.updates)
        self.finishing = True
        self.to_rank(self.engine_ranks[0], ("checkpoint",))
        while True:
            msg = self.next_message()
            if msg[0] == "checkpointed":
                break
            if msg[0] in ("terminated", "assessed"):
                self.handle(msg)
        checkpoint.save_state(self.run_dir, {"updates": self.updates, "version": msg[1]})
        self.status = checkpoint.EXIT_CHECKPOINTED
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """Cancel running harnesses, record every dispatched execution, stop all ranks."""
        self.finishing = True
        running = [self.eid[x] for x, s in self.state.items() if s in ("running", "terminated")]
        self.to_proxy(("cancel", running))
        deadline = time.time() + self.cfg.timeouts.drain_s
        while any(s in ("running", "terminated") for s in self.state.values()):
            msg = self.next_message(max(0.1, deadline - time.time()))
            if msg[0] in ("terminated", "assessed"):
                self.handle(msg)
            if time.time() > deadline:
                break
        # never stop a cell in the middle of restarting its engine: let the restart finish
        deadline = time.time() + self.cfg.timeouts.startup_s
        while self.respawning and time.time() < deadline:
            msg = self.next_message(max(0.1, deadline - time.time()))
            if msg[0] == "engine_ready":
                self.handle(msg)
        for x, s in self.state.items():
            if s == "queued":
                self._record_not_launched(x)
        self.rec.close_roles()
        summary = self.summary()
        self.rec.event("finished", **{k: v for k, v in summary.items() if k != "steps"})
        self.rec.close()
        self.to_proxy(("stop", self.status))
        for rank in self.engine_ranks:
            self.to_rank(rank, ("stop", self.status))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _record_not_launched(self, x: int) -> None:
        from gyre.trajectory.tree import TrajectoryTree

        g = x // self.n
        self.rec.open_execution(self.eid[x], {"group": self.gid(g), "task": self.group_task[g]})
        verdict: dict[str, Any] = {"status": "excluded", "reward": None, "assessments": [], "t": time.time(),
                   "error": "dispatched but never launched before the run ended"}  # fmt: skip
        self.rec.close_execution(self.eid[x], self.gid(g), TrajectoryTree(self.eid[x]),
                                 "not_launched", verdict)  # fmt: skip

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "policy": self.cfg.schedule.policy,
            "status": self.status,
            "resumed_from": self.resumed,
            "steps_done": self.updates,
            "wall_s": time.time() - self.t0,
            "executions": len(self.eid),
            "switch_s_mean": sum(self.switch_seconds) / max(1, len(self.switch_seconds)),
            **self.stats,
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
            "loss": last.get("loss"), **self.stats,
        }  # fmt: skip
        print("GYRE-PROGRESS " + json.dumps(line), flush=True)


def _engine_id(index: int) -> str:
    return f"e{index}"


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
MESSAGES: dict[str, Callable[..., None]] = {
    "drained": Coordinator.on_drained,
    "switched": Coordinator.on_switched,
    "terminated": Coordinator.on_terminated,
    "assessed": Coordinator.on_assessed,
    "prepassed": Coordinator.on_prepassed,
    "updated": Coordinator.on_updated,
    "published": Coordinator.on_published,
    "engine_lost": Coordinator.on_engine_lost,
    "engine_ready": Coordinator.on_engine_ready,
}
