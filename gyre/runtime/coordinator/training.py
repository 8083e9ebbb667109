"""The coordinator's side of streaming training: one batch's life, from ready groups to one update.

This is the one implementation of the training protocol (docs/training.md); `gyre run`, the
real-`mpiexec` invariance tests and `tools/bench_training.py` all drive it. The scheduler
decides *who* works *when*; this object decides *what* the work is:

* `admit` — a ready group enters the `StreamPackingBuffer` (admission ≤ J_max, packing);
  its new micro-steps queue for their **prepass**;
* `claim(cell, PREPASS, count)` — the cell gets a window of the next `count` micro-steps
  (the scheduler's `window`: what is queued, at most) for a no-grad forward and returns each
  one's per-execution sums of l_t − b_t (`prepassed`);
* once every micro-step holding rows of an execution is prepassed, that execution's
  sequence ratio and gate are final; a micro-step whose executions are all final is
  **ready** for its gradient pass (`prepassed` returns how many became ready);
* `claim(cell, GRADIENT, count)` — a cell of the training prefix gets a window of ready
  micro-steps with their executions' scalars and accumulates their gradient (`accumulated`);
* `update(cells)` — when every pass is done, cells 0..m−1 sum their gradients at the core,
  which scales by 1/E, clips, steps AdamW once and broadcasts (`updated`).

Whichever cells claim whichever passes, the update is the same: every micro-step's gradient
pass depends only on the batch's weights and its executions' final scalars.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import TrainingError
from gyre.runtime.shared import audit
from gyre.runtime.shared import messages as msg
from gyre.schedule.events import Work
from gyre.train.config import TrainConfig
from gyre.train.packing import MicroStep, oversize
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.train.scalars import ExecutionScalar, execution_scalars
from gyre.train.stream import ReadyGroup, StreamPackingBuffer

SendToCell = Callable[[int, msg.Message], None]


@dataclass(slots=True)
class BatchStats:
    """What one batch reports (the trace's `steps` rows)."""

    objective: float = 0.0  # E * J at the batch's weights (sum of c_t)
    targets: int = 0
    grad_norm: float = math.nan
    microsteps: int = 0
    executions: int = 0  # E
    gated: int = 0  # executions whose clipping gate is 0
    groups: int = 0
    tied_groups: int = 0  # groups whose valid rewards all tie: no learning signal
    oversize_rows: int = 0  # paths longer than token_budget, each trained alone
    rewards: list[float] = field(default_factory=list)
    task_rewards: dict[str, list[float]] = field(default_factory=dict)  # task -> valid rewards
    response_tokens: list[int] = field(default_factory=list)  # per execution: sampled tokens
    turns: list[int] = field(default_factory=list)  # per execution: model calls
    staleness: list[int] = field(default_factory=list)
    prepass_s: float = 0.0
    gradient_s: float = 0.0
    passes_by_cell: dict[int, int] = field(default_factory=dict)


class TrainingPlane:
    """Batch book-keeping on the coordinator; sends work to cells through `send`."""

    def __init__(
        self, cfg: TrainConfig, *, groups_per_batch: int, group_size: int, send: SendToCell,
        audit_dir: Path | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.audit_dir = audit_dir if cfg.record_batches else None
        self.objective = cfg.objective
        self.buffer = StreamPackingBuffer(
            cfg.stream(groups_per_batch=groups_per_batch, group_size=group_size)
        )
        self.send = send
        self.batch = -1
        self.version = 0
        self._reset()

    def _reset(self) -> None:
        self.prepass_queue: deque[MicroStep] = deque()
        self.gradient_queue: deque[MicroStep] = deque()
        self.steps: dict[int, MicroStep] = {}
        self.sums: dict[str, float] = {}
        self.rows_left: dict[str, int] = {}  # execution -> rows not yet prepassed
        self.scalars: dict[str, ExecutionScalar] = {}
        self.waiting: dict[int, set[str]] = {}  # step -> executions not yet final
        self.stats = BatchStats()
        self.updaters: set[int] = set()
        self.passes: dict[int, dict[str, int]] = {}  # step -> {"prepass": cell, "gradient": cell}
        self.windows: list[tuple[str, int, tuple[int, ...]]] = []  # (work, cell, micro-steps)
        self.t_first: float | None = None  # when the batch's first pass was sent
        self.t_update: float | None = None  # when its update began (every pass done)
        self.t_done: float | None = None  # when its update finished
        self.new_set_aside: list[str] = []  # groups the last admit set aside
        self._set_aside_seen = 0

    # ------------------------------------------------------------------ the batch

    def begin(self, batch: int, version: int) -> None:
        """A new batch at the core's weights of `version` (the join window opened)."""
        self.buffer.begin_batch()
        self.batch, self.version = batch, version
        self._reset()

    def admit(
        self, group_id: str, version: int, staleness: int, outcomes: list[ExecutionOutcome],
        trees: dict[str, Any], task: str = "",
    ) -> int:  # fmt: skip
        """Take a ready group (of `task`); returns how many micro-steps were queued for their
        prepass."""
        st = self.stats
        st.groups += 1
        st.staleness.append(staleness)
        valid = [o.reward for o in outcomes if o.status is Status.VALID and o.reward is not None]
        st.rewards += valid
        st.task_rewards.setdefault(task, []).extend(valid)
        for o in outcomes:  # what the policy did in each execution that was assessed
            tree = trees.get(o.execution_id)
            if o.status is Status.VALID and tree is not None:
                st.turns.append(len(tree))
                st.response_tokens.append(sum(len(n.output_ids) for n in tree.nodes))
        usable = [0.0 if o.status is Status.PLACEHOLDER else o.reward for o in outcomes
                  if o.status is not Status.EXCLUDED]  # fmt: skip
        if len(set(usable)) <= 1:
            st.tied_groups += 1
        self.buffer.add_ready(
            ReadyGroup(group_id=group_id, policy_version=version, outcomes=outcomes, trees=trees)
        )
        new = self.buffer.pull()
        info = self.buffer.batch_info()
        self.new_set_aside = info.set_aside[self._set_aside_seen :]
        self._set_aside_seen = len(info.set_aside)
        for eid, rows in info.rows.items():
            self.rows_left.setdefault(eid, rows)
        for step in new:
            self.steps[step.index] = step
            self.waiting[step.index] = {r.execution_id for r in step.rows}
        self.prepass_queue.extend(new)
        st.microsteps += len(new)
        st.oversize_rows += oversize((r for step in new for r in step.rows), self.cfg.token_budget)
        return len(new)

    def claim(self, cell: int, work: Work, count: int = 1) -> None:
        """Send `cell` its pass: a window of the next `count` prepasses, or of the next
        `count` ready gradient passes."""
        if self.t_first is None:
            self.t_first = time.time()
        if work is Work.PREPASS:
            steps = self._pop(self.prepass_queue, "prepass", count)
            self.send(cell, msg.Prepass(batch=self.batch, version=self.version, steps=steps))
            return
        steps = self._pop(self.gradient_queue, "gradient", count)
        mine = {e: self.scalars[e] for step in steps for e in {r.execution_id for r in step.rows}}
        self.send(cell, msg.Accumulate(batch=self.batch, version=self.version, steps=steps,
                                       scalars=mine))  # fmt: skip

    def _pop(self, queue: deque[MicroStep], what: str, count: int) -> tuple[MicroStep, ...]:
        if len(queue) < count:
            raise TrainingError(f"batch {self.batch}: a {what} claim of {count} found "
                                f"{len(queue)} queued")  # fmt: skip
        return tuple(queue.popleft() for _ in range(count))

    def prepassed(self, m: msg.Prepassed) -> int:
        """Record a window's prepasses; returns how many micro-steps became ready for their
        gradient."""
        self._count(m.cell, m.indices, m.seconds, Work.PREPASS)
        for index, sums in zip(m.indices, m.sums, strict=True):
            step = self.steps[index]
            for eid, value in sorted(sums.items()):
                self.sums[eid] = self.sums.get(eid, 0.0) + value
            for row in step.rows:
                self.rows_left[row.execution_id] -= 1
            final = {r.execution_id for r in step.rows if self.rows_left[r.execution_id] == 0}
            if final:
                self._finalize(final)
        ready = [i for i, left in self.waiting.items() if not (left - self.scalars.keys())]
        for i in sorted(ready):
            del self.waiting[i]
            self.gradient_queue.append(self.steps[i])
        return len(ready)

    def _finalize(self, executions: set[str]) -> None:
        """Sequence ratio and gate of executions whose every row is prepassed."""
        info = self.buffer.batch_info().executions
        new = execution_scalars(
            {e: self.sums[e] for e in executions}, {e: info[e] for e in executions},
            self.objective,
        )  # fmt: skip
        self.scalars.update(new)
        self.stats.gated += sum(1 for s in new.values() if s.gate == 0.0)

    def accumulated(self, m: msg.Accumulated) -> None:
        self._count(m.cell, m.indices, m.seconds, Work.GRADIENT)
        self.stats.objective += m.objective
        self.stats.targets += m.targets

    def _count(self, cell: int, indices: tuple[int, ...], seconds: float, work: Work) -> None:
        st = self.stats
        st.passes_by_cell[cell] = st.passes_by_cell.get(cell, 0) + len(indices)
        for index in indices:
            self.passes.setdefault(index, {})[work.value] = cell
        self.windows.append((work.value, cell, indices))
        if work is Work.GRADIENT:
            st.gradient_s += seconds
        else:
            st.prepass_s += seconds

    def update(self, cells: tuple[int, ...]) -> None:
        """Every pass is done: cells 0..m-1 reduce to the core, which updates once."""
        if cells != tuple(range(len(cells))):
            raise TrainingError(f"training cells {cells} are not a prefix 0..m-1")
        if self.waiting or self.prepass_queue or self.gradient_queue:
            raise TrainingError(f"batch {self.batch}: update before every pass was done")
        info = self.buffer.batch_info()
        e = info.num_executions
        self.stats.executions = e
        self.updaters = set(cells)
        self.t_update = time.time()
        if self.audit_dir is not None:
            audit.record_steps(self.audit_dir, self.batch, {
                "version": self.version, "steps": [self.steps[i] for i in sorted(self.steps)],
                "executions": dict(info.executions), "num_executions": e, "cells": cells,
                "passes": self.passes, "windows": self.windows,
                "scalars": dict(self.scalars)})  # fmt: skip
        for c in cells:
            self.send(c, msg.Reduce(batch=self.batch, cells=len(cells), num_executions=e))

    def updated(self, m: msg.Updated) -> bool:
        """A cell's part of the update; True once every updater reported."""
        if m.grad_norm is not None:
            self.stats.grad_norm = m.grad_norm
        self.updaters.discard(m.cell)
        if not self.updaters:
            self.t_done = time.time()
        return not self.updaters

    def metrics(self) -> dict[str, float]:
        """The batch's step metrics (the trace's `steps` table; docs/runtime.md)."""
        st = self.stats
        e = max(1, st.executions)
        rewards = st.rewards or [math.nan]
        ratios = [math.exp(s.log_ratio) for s in self.scalars.values()] or [math.nan]
        train_wall = (self.t_done or math.nan) - (self.t_first or math.nan)
        tokens = sum(r.length for step in self.steps.values() for r in step.rows)
        return {
            "loss": -st.objective / e / max(1, st.targets),
            "objective": st.objective / e,
            "targets": float(st.targets),
            "grad_norm": st.grad_norm,
            "reward_mean": sum(rewards) / len(rewards),
            "tied_groups": st.tied_groups / max(1, st.groups),
            "gated_executions": st.gated / e,
            "ratio_mean": sum(ratios) / len(ratios),
            "ratio_max": max(ratios),
            "staleness_mean": sum(st.staleness) / max(1, len(st.staleness)),
            "staleness_max": float(max(st.staleness, default=0)),
            "response_tokens_mean": _mean(st.response_tokens),
            "turns_mean": _mean(st.turns),
            "microsteps": float(st.microsteps),
            "oversize_rows": float(st.oversize_rows),
            "executions": float(st.executions),
            "set_aside_groups": float(len(self.buffer.batch_info().set_aside)),
            "prepass_s": st.prepass_s,
            "gradient_s": st.gradient_s,
            "train_wall_s": train_wall,
            "train_tokens_per_s": tokens / train_wall if train_wall > 0 else math.nan,
            "update_s": (self.t_done or math.nan) - (self.t_update or math.nan),
        }

    def task_rewards(self) -> dict[str, float]:
        """The batch's mean valid reward of each task it trained (tasks without one: NaN)."""
        return {task: _mean(r) for task, r in sorted(self.stats.task_rewards.items())}


def _mean(values: list[int] | list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
