"""A resumed run's take-over: the dead job's untrained groups re-enter the ledger, its open
executions are closed, and the groups worth training are carried into the scheduler
(docs/runtime.md "Crashes and resume").

A `Resume` reads the newest checkpoint and, with `recovery.read_trace`, what the trace
holds beyond it; `reopen` acts on that before the scheduler starts: each untrained group
enters the ledger with its members; an execution that was running is scored again from its
preserved workspace (a `Rescore` to the proxy node, which holds it) and closed with its
journaled tree when its `Assessed` comes back; one that made no model call is closed
unrecoverable, one that never launched as not launched. Once every rescore is in, `carry`
keeps the groups with a usable execution, renumbered 0..c-1. `close_not_launched` also
closes what a run's end left unlaunched.

`check_run_dir` is the preflight's view of the same take-over (`gyre run --resume`, `gyre run
--run-dir` of an existing run, the job's first step): it builds the `Resume` the coordinator
will build and refuses, in one line, what the take-over would trip over: a trace or
checkpoint that does not read back, a config other than the run's own (without `--resume`),
fewer steps than the run has done, groups of another size, a model of another shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.errors import ConfigError
from gyre.runtime.coordinator.ledger import Execution, ExecutionState, Group, Ledger
from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.coordinator.recovery import CarriedGroup, MemberState, read_trace
from gyre.runtime.shared import checkpoint
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.checkpoint import CheckpointState
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import CloseStatus

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig


class Resume:
    """Where a run starts: the newest checkpoint's driver state and the trace's take-over
    (neither for a fresh run), then the groups carried and the executions being rescored."""

    def __init__(self, run_dir: Path) -> None:
        found = checkpoint.latest(run_dir)
        self.state = CheckpointState.of(found[1]) if found is not None else None
        self.trained: list[str] = sorted(self.state.trained) if self.state else []
        trace = run_dir / "trace.h5"
        self.takeover = read_trace(trace, set(self.trained)) if trace.exists() else None
        self.carried = 0  # scheduler groups 0..carried-1 were taken over from the trace
        self.recovering: dict[int, TrajectoryTree] = {}  # execution -> its journaled tree

    def group_number(self, group: int) -> int:
        """The run-wide number of scheduler group `group` (its id g<number>, unique across
        resumes)."""
        first_new = self.takeover.next_group if self.takeover else 0
        return first_new + group - self.carried

    def reopen(
        self, ledger: Ledger, rec: RunRecorder, to_proxy: Callable[[msg.Message], None]
    ) -> None:
        """Enter the taken-over groups in `ledger`; an execution sent to be scored again waits
        in `recovering` (its `Assessed` closes it with the journaled tree)."""
        assert self.takeover is not None
        self.check_groups(ledger.n)
        for cg in self.takeover.groups:
            g = len(ledger.groups)
            first = len(ledger.executions)
            ledger.add(Group(cg.id, cg.task, cg.instance, cg.version), [
                Execution(id=m.id, group=g, state=ExecutionState.RECORDED, outcome=m.outcome,
                          verdict=m.verdict, tree=m.tree) for m in cg.members
            ])  # fmt: skip
            for i, m in enumerate(cg.members, start=first):
                x = ledger.executions[i]
                if m.state is MemberState.OPEN and m.tree is not None and len(m.tree):
                    x.state, x.outcome = ExecutionState.TERMINATED, CloseStatus.RECOVERED
                    self.recovering[i] = m.tree
                    to_proxy(msg.Rescore(i, m.id, cg.task, cg.instance))
                elif m.state is MemberState.OPEN:  # no model call yet: its reward would say nothing
                    close_unrecoverable(ledger, rec, i, "the job died before it made a model call")
                elif m.state is MemberState.UNLAUNCHED:
                    close_not_launched(ledger, rec, i, "the job died first")

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
        self.check_groups(cfg.schedule.scheduler(cfg.topology)[0].executions_per_group)
        if self.state is not None or self.takeover is not None:
            from gyre.models import check_same_shape

            check_same_shape(cfg.model, run_model)

    def carry(self, ledger: Ledger) -> tuple[list[CarriedGroup], list[str]]:
        """The groups with a usable execution (kept, renumbered 0..c-1) and the ids of the rest."""
        assert self.takeover is not None
        carried: list[CarriedGroup] = []
        dropped = []
        for g, cg in enumerate(self.takeover.groups):
            if ledger.usable(g):
                carried.append(cg)
            else:
                dropped.append(cg.id)
        ledger.keep_only({c.id for c in carried})
        self.carried = len(carried)
        return carried, dropped


def close_unrecoverable(ledger: Ledger, rec: RunRecorder, i: int, why: str) -> None:
    """An execution a dead job left open that cannot be scored: excluded, with the reason."""
    x = ledger.executions[i]
    verdict = msg.VerdictRecord.excluded(f"unrecoverable: {why}", time.time())
    rec.close_execution(x.id, ledger.groups[x.group].id, rec.journaled_tree(x.id),
                        CloseStatus.UNRECOVERABLE, verdict)  # fmt: skip
    x.state, x.outcome, x.verdict = ExecutionState.RECORDED, CloseStatus.UNRECOVERABLE, verdict


def close_not_launched(ledger: Ledger, rec: RunRecorder, i: int,
                       why: str = "the run ended first") -> None:  # fmt: skip
    """A dispatched execution that never launched (the run ended, or the job died, first)."""
    x, g = ledger.executions[i], ledger.group_of(i)
    rec.open_execution(x.id, {"group": g.id, "task": g.task, "instance": g.instance})
    verdict = msg.VerdictRecord.excluded(f"dispatched, never launched: {why}", time.time())
    rec.close_execution(x.id, g.id, TrajectoryTree(x.id), CloseStatus.NOT_LAUNCHED, verdict)
    x.state, x.outcome, x.verdict = ExecutionState.RECORDED, CloseStatus.NOT_LAUNCHED, verdict


def check_run_dir(run_dir: Path, cfg: RunConfig, *, key: str, same_config: bool,
                  steps: bool = True) -> None:  # fmt: skip
    """Refuse to start `cfg` in `run_dir` (named by `key`: --resume, --run-dir) when the run
    already there cannot be continued with it: with `same_config`, any config other than the
    run's own (`steps` aside); always, what `Resume.check` refuses or a trace or checkpoint
    that does not read back. A new or empty directory passes."""
    from gyre.config import to_dict
    from gyre.runtime.shared.config import dump_run_config, load_run_config

    own = run_dir / "config.yaml"
    if not own.is_file():
        if (run_dir / "trace.h5").exists() or (run_dir / checkpoint.CHECKPOINTS).exists():
            raise ConfigError(f"{key} {run_dir}: holds a trace or checkpoints but no "
                              "config.yaml; allowed: a run directory gyre run made, or a new one")  # fmt: skip
        return
    try:  # with this job's steps: a requeued job may run its config with --steps
        run_cfg = load_run_config(own, steps=cfg.steps)
    except ConfigError as e:
        raise ConfigError(f"{key} {run_dir}: its config.yaml does not load ({e}); allowed: a "
                          "run directory of this Gyre version, or a new one") from None  # fmt: skip
    if same_config and dump_run_config(run_cfg) != dump_run_config(cfg):
        where, mine, theirs = _first_difference(to_dict(cfg), to_dict(run_cfg))
        raise ConfigError(
            f"{key} {run_dir}: holds a run of another config ({where}: {mine!r}, the run's: "
            f"{theirs!r}); allowed: the run's own config (gyre run --resume {run_dir} "
            "[KEY.PATH=VALUE ...] continues it with overrides), or a new run directory"
        )
    try:
        resume = Resume(run_dir)
    except Exception as e:  # a damaged trace or checkpoint: h5py, JSON and key errors
        raise ConfigError(
            f"{key} {run_dir}: its trace or checkpoint does not read back "
            f"({type(e).__name__}: {' '.join(str(e).split())}); allowed: a run directory whose "
            f"trace.h5 opens (gyre trace show {run_dir}), or a new run directory"
        ) from None
    resume.check(cfg, run_cfg.model, steps=steps)


def _first_difference(a: object, b: object, path: str = "") -> tuple[str, object, object]:
    """The first key path where the nested mappings `a` and `b` differ, and both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return path, a, b
