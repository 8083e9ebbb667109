"""What a job takes over from the run directory it continues: the newest checkpoint's driver
state, the groups those weights trained, and what the trace holds beyond them (docs/runtime.md
"Crashes and resume").

`Handover(run_dir)` reads both once, before the coordinator reopens the trace for writing;
`read_trace(path, trained)` returns the trace's `Takeover`: per dispatched, untrained group
its task instance, dispatch version and members; per member either its closed verdict and
tree, the partial tree journaled while it ran (to be scored from its preserved workspace),
or nothing at all (it never launched). `Handover.check` refuses a config the take-over would
trip over. Pure reading; no process is started here.

Two readers build the same `Handover`: the coordinator, whose `Resume`
(`gyre.runtime.coordinator.resume`) acts on it, and the preflight's run-directory check
(`gyre.runtime.shared.run_directory.check_run_dir`), which refuses a config before any process
starts.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.errors import ConfigError
from gyre.runtime.shared import checkpoint
from gyre.runtime.shared.checkpoint import CheckpointState
from gyre.runtime.shared.messages import VerdictRecord
from gyre.trajectory.reader import TraceReader
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import CloseStatus, VerdictStatus

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig


class MemberState(enum.Enum):
    """What the trace says of a taken-over group's execution."""

    CLOSED = "closed"  # closed with its verdict (and, when scored, its tree)
    OPEN = "open"  # opened, never closed: its journaled tree is to be scored
    UNLAUNCHED = "unlaunched"  # dispatched, never opened


@dataclass(slots=True)
class Member:
    """One execution of a taken-over group."""

    id: str
    state: MemberState
    verdict: VerdictRecord | None = None  # closed: status + reward (no assessment rows)
    outcome: CloseStatus = CloseStatus.NOT_LAUNCHED  # closed: the execution's close status
    tree: TrajectoryTree | None = None  # closed & scored: its tree; open: the journal's


@dataclass(slots=True)
class CarriedGroup:
    """A dispatched group the checkpointed weights have not trained."""

    id: str
    task: str
    instance: int
    version: int
    members: list[Member] = field(default_factory=list)


@dataclass(slots=True)
class Takeover:
    """The trace's view of a resumed run."""

    groups: list[CarriedGroup]
    next_group: int  # the first unused group number (g<n>)
    executions: int  # executions recorded in the trace so far


class Handover:
    """What `run_dir` hands the job that continues it: the newest checkpoint's driver state
    and the groups it trained, and the trace's take-over (neither for a fresh run)."""

    def __init__(self, run_dir: Path) -> None:
        found = checkpoint.latest(run_dir)
        self.state = CheckpointState.of(found[1]) if found is not None else None
        self.trained: list[str] = sorted(self.state.trained) if self.state else []
        trace = run_dir / "trace.h5"
        self.takeover = read_trace(trace, set(self.trained)) if trace.exists() else None

    def check_groups(self, n: int) -> None:
        """Every taken-over group has the `n` executions per group the config runs."""
        for cg in self.takeover.groups if self.takeover else []:
            if len(cg.members) != n:
                raise ConfigError(
                    f"schedule.group_size + schedule.oversample: {n}, but the run's group "
                    f"{cg.id} has {len(cg.members)} executions; allowed: {len(cg.members)} (the "
                    "run's own) to continue it"
                )

    def check(self, cfg: RunConfig, run_model: str, *, steps: bool = True) -> None:
        """Refuse a config this take-over cannot continue with: fewer `steps` than the
        checkpoint has done (not checked when `steps` is False: the job's --steps is unknown),
        groups of another size, another model shape than the run's `run_model`."""
        done = self.state.updates if self.state else 0
        if steps and cfg.steps < done:  # equal: a run killed after its last update finishes
            raise ConfigError(
                f"steps: {cfg.steps}, but the run has done {done} updates (its newest "
                f"checkpoint); allowed: steps >= {done} (--steps N)"
            )
        self.check_groups(cfg.scheduler()[0].executions_per_group)
        if self.state is not None or self.takeover is not None:
            from gyre.models import check_same_shape

            check_same_shape(cfg.model, run_model)


def read_trace(path: Path, trained: set[str]) -> Takeover:
    """The untrained groups of the trace at `path` and the state of their executions."""
    with TraceReader(path) as r:
        infos = {i.execution_id: i for i in r.executions()}
        journal = r.recover()
        dispatched: dict[str, CarriedGroup] = {}
        for row in r.rows("groups"):
            gid = row["group_id"]
            g = dispatched.get(gid)
            if g is None:
                task, _, inst = row["task_id"].partition("@")
                g = dispatched[gid] = CarriedGroup(
                    id=gid, task=task, instance=int(inst or 0), version=int(row["policy_version"])
                )
            g.members.append(Member(id=row["execution_id"], state=MemberState.UNLAUNCHED))
        numbers = [
            int(gid.rsplit("g", 1)[1]) for gid in dispatched if gid.rsplit("g", 1)[1].isdigit()
        ]
        carried = [g for gid, g in dispatched.items() if gid not in trained]
        for g in carried:
            for m in g.members:
                _fill(m, infos.get(m.id), journal, r)
    return Takeover(groups=carried, next_group=max(numbers, default=-1) + 1,
                    executions=len(infos))  # fmt: skip


def _fill(m: Member, info: Any, journal: dict[str, TrajectoryTree], r: TraceReader) -> None:
    if info is None:
        return  # dispatched, never opened: it never launched
    if not info.closed:
        m.state, m.tree = MemberState.OPEN, journal.get(m.id) or TrajectoryTree(m.id)
        return
    meta = info.meta
    reward = meta.get("reward")
    if isinstance(reward, float) and math.isnan(reward):
        reward = None
    m.state, m.outcome = MemberState.CLOSED, CloseStatus(info.status)
    status = VerdictStatus(meta.get("verdict", VerdictStatus.EXCLUDED.value))
    m.verdict = VerdictRecord(status=status, reward=reward, t=info.t_close or info.t_open)
    if status is VerdictStatus.SCORED:
        m.tree = r.tree(m.id)
