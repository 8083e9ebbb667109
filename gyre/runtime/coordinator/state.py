"""What the coordinator knows, and how it reaches the other ranks.

Built once from the run config: the scheduler, the engines (`Fleet`), the groups and
executions (`Ledger`), the trace (`RunRecorder`), counters and step rows (`Progress`), the
training plane, checkpoints, oversampling's book-keeping, a resumed run's `Resume`, the
ranks it talks to (`Ranks`, the `Layout`'s) and the step counters; and its three ways to
send (`to_proxy`, `to_cell`, `to_rank`). The `Coordinator` (coordinator.py) is this state
with the loop and its handlers; the rooms beside it — the run's start (opening.py), its
engines (engines.py), its end (closing.py) — are functions of this state, so none of them
imports the coordinator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.config import to_dict
from gyre.runtime.coordinator import resume
from gyre.runtime.coordinator.fleet import Fleet
from gyre.runtime.coordinator.inbox import Inbox
from gyre.runtime.coordinator.ledger import Ledger
from gyre.runtime.coordinator.oversampling import Oversampling
from gyre.runtime.coordinator.progress import Progress, Validation
from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.coordinator.training import TrainingPlane
from gyre.runtime.shared import checkpoint, wire
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import RunConfig
from gyre.runtime.shared.layout import PROXY_RANK, Ranks
from gyre.runtime.shared.startup import StartupClock, StartupProfile
from gyre.schedule import Feed, Scheduler, make_policy
from gyre.tracking import open_tracker


class CoordinatorState:
    """The coordinator's state: scheduler, trace, training book-keeping, the ranks' links."""

    feed: Feed[Any]  # the scheduler's feed loop, over the Coordinator's actions
    inbox: Inbox  # every wait for a message, handled by the Coordinator's handlers

    def __init__(
        self, cfg: RunConfig, link: wire.Link, run_dir: Path, ranks: Ranks | list[int],
        meta: dict, startup: StartupClock | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.link, self.run_dir = cfg, link, run_dir
        self.profile = StartupProfile(startup or StartupClock({}))  # start-up, every rank
        if not isinstance(ranks, Ranks):  # a bare list of engine ranks: one rank per cell
            ranks = Ranks.one_per_cell(ranks, cfg.topology.cells)
        self.ranks = ranks  # each engine's rank and each cell's (`Layout.ranks`)
        self.hosts: list[str] = list(meta.get("hosts", []))  # per world rank: node or host
        sc, pc = cfg.scheduler()
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
        self.fleet = Fleet(sc.engines_per_cell)
        self.ledger = Ledger(self.per_group)
        self.progress = Progress(cfg, self.sched, self.ledger, self.rec, self.tracker)
        self.stats = self.progress.stats
        self.oversampling = Oversampling(self.n, self.ledger, self.rec, self.stats, self.to_proxy)
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
        self.sampled_tokens = 0  # policy tokens of every call journaled (rollout throughput)
        self.last_update = (self.t0, 0)  # (when, sampled_tokens then) of the last update
        self.finishing = False
        self.proxy_url = ""
        self.judges: list[str] = []  # the judge engines' URLs (never published to)
        self.published_to: dict[int, list[str]] = {}  # version -> the URLs it was sent to
        resumed = self.resume.state.version if self.resume.state is not None else None
        self.validation = Validation.of(cfg.eval.every_steps, resumed)  # eval.every_steps

    def to_proxy(self, m: msg.Message) -> None:
        self.link.send(m, PROXY_RANK)

    def to_rank(self, rank: int, m: msg.Message) -> None:
        self.link.send(m, rank)

    def to_cell(self, cell: int, m: msg.Message) -> None:
        """A training or role message to every rank of `cell` (each takes its share; the
        leader answers)."""
        for rank in self.ranks.cells[cell]:
            self.link.send(m, rank)

    def where(self) -> str:
        """Where the run stands (a stalled run's error says it)."""
        s = self.sched
        return (f"step {self.updates}, waterlevel {s.waterlevel}, phase {s.phase.value}, "
                f"roles {[r.value for r in s.roles]}")  # fmt: skip
