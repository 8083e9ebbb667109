"""What a run reports as it goes and at its end: step rows, held-out points, progress lines,
the summary.

The coordinator counts (`stats`), and after every optimizer update hands `step` the batch's
`StepMetrics`: its row goes into the trace, the tracker and `summary.json`'s `steps`; a
step without learning signal or with nothing to train is an event and a GYRE-WARNING line,
and too many empty batches in a row stop the run with the executions' outcomes. `line`
prints the GYRE-PROGRESS JSON that `gyre run` renders live; `summary` is `summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.models import model_family
from gyre.runtime.coordinator.ledger import Ledger
from gyre.runtime.coordinator.record import RunRecorder
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import wire
from gyre.runtime.shared.checkpoint import CheckpointState
from gyre.runtime.shared.config import RunConfig
from gyre.schedule import Scheduler
from gyre.tracking import Tracker

TRAIN, ROLLOUT = "train/", "rollout/"
"""Tracker namespaces of the step metrics (held-out evaluation's: `gyre.tracking.EVAL_PREFIX`)."""


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One optimizer step's metrics: the trace's `steps` rows, `summary.json`'s `steps`, the
    trackers' `train/` and `rollout/` series (`tags`).

    The batch's training metrics (`TrainingPlane.metrics()`, docs/runtime.md "Step
    metrics") and what the coordinator adds: the step's learning rate, the cells that
    trained it, how long it took, the rollout throughput, the reward of each task."""

    loss: float
    objective: float
    targets: float
    grad_norm: float
    reward_mean: float
    tied_groups: float  # share of the batch's groups whose rewards all tie
    gated_executions: float  # the clip fraction: share of executions whose gate is 0
    ratio_mean: float  # importance weights: the executions' sequence ratios exp(S_i)
    ratio_max: float
    staleness_mean: float
    staleness_max: float
    response_tokens_mean: float  # tokens the policy sampled per scored execution
    turns_mean: float  # model calls per scored execution
    microsteps: float
    oversize_rows: float
    executions: float  # executions trained; 0: the batch had nothing to train
    set_aside_groups: float
    prepass_s: float
    gradient_s: float
    train_wall_s: float
    train_tokens_per_s: float  # the batch's row tokens over its training wall time
    update_s: float
    lr: float  # the learning rate of this update (`train.lr_schedule`)
    train_cells: float  # cells that trained the batch (> 1: satellites joined)
    step_s: float  # since the previous update (the run's start for the first)
    rollout_tokens_per_s: float  # policy tokens sampled over step_s, every engine together
    duration_s: float  # from the batch's join window opening to its update
    elapsed_s: float  # since the run started
    task_rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    """Mean valid reward of each task the batch trained (rows `reward/<task>`)."""

    def to_row(self) -> dict[str, float]:
        """Metric name -> value, in field order (the keys the trace and JSON have always had),
        then `reward/<task>` per task."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "task_rewards"}  # fmt: skip
        return row | {f"reward/{task}": v for task, v in self.task_rewards.items()}


ROLLOUT_METRICS = frozenset({"reward_mean", "tied_groups", "staleness_mean", "staleness_max",
                             "response_tokens_mean", "turns_mean", "executions",
                             "set_aside_groups", "rollout_tokens_per_s"})  # fmt: skip
"""Step metrics about what the rollouts did; the rest are about training (`tags`)."""


def tags(row: dict[str, float]) -> dict[str, float]:
    """A step row under the trackers' namespaces: `rollout/<name>` (and each task's
    `rollout/reward/<task>`), else `train/<name>`."""
    return {(ROLLOUT if k in ROLLOUT_METRICS or k.startswith("reward/") else TRAIN) + k: v
            for k, v in row.items()}  # fmt: skip


@dataclass(slots=True)
class Validation:
    """When the next evaluation is due, the one in flight, and the points recorded."""

    every: int  # eval.every_steps; 0: off
    next_due: int = 0  # the step from which the next evaluation starts
    in_flight: int | None = None  # its step
    points: list[dict[str, Any]] = field(default_factory=list)  # summary.json `evals`

    @classmethod
    def of(cls, every: int, resumed_version: int | None) -> Validation:
        """A new run starts with step 0's; a resumed one with the first due after its step."""
        first = (
            0 if resumed_version is None or not every else (resumed_version // every + 1) * every
        )
        return cls(every=every, next_due=first)

    def due(self, version: int) -> bool:
        return self.every > 0 and self.in_flight is None and version >= self.next_due


def point(m: msg.Evaluated) -> dict[str, Any]:
    """An evaluation's curve point: mean and spread of its valid rewards, and what ran it."""
    got = [r for r in m.rewards.values() if r is not None]
    mean = sum(got) / len(got) if got else math.nan
    std = math.sqrt(sum((r - mean) ** 2 for r in got) / (len(got) - 1)) if len(got) > 1 else 0.0
    return {"step": m.step, "reward_mean": mean, "reward_std": std, "scored": len(got),
            "excluded": len(m.rewards) - len(got), "versions": list(m.versions),
            "engines": list(m.engines), "t_start": m.t_start, "t_end": m.t_end,
            "seconds": m.t_end - m.t_start}  # fmt: skip


class Progress:
    """The run's counters, step rows and kept policies, and the lines made of them."""

    def __init__(
        self, cfg: RunConfig, sched: Scheduler, ledger: Ledger, rec: RunRecorder, tracker: Tracker
    ) -> None:
        self.cfg, self.sched, self.ledger, self.rec, self.tracker = cfg, sched, ledger, rec, tracker
        self.stats = {"reroutes": 0, "switches": 0, "harness_errors": 0, "engine_losses": 0,
                      "publications": 0, "no_signal_steps": 0, "empty_steps": 0,
                      "set_aside_groups": 0}  # fmt: skip
        self.empty_in_a_row = 0
        self.switch_seconds: list[float] = []
        self.step_rows: list[StepMetrics] = []
        self.policies: list[str] = []
        self.last_progress = 0.0
        self.last_step = -1  # the step of the last progress line
        self.t0 = time.time()

    def step(self, updates: int, metrics: StepMetrics) -> None:
        """Record update `updates`' metrics; warn about a step that taught nothing."""
        self.step_rows.append(metrics)
        row = metrics.to_row()
        self.rec.step(updates, row)
        self.tracker.log_step(updates, tags(row))
        self.rec.dispatch(self.sched.version, 0, 0, self.sched)
        self.stats["set_aside_groups"] += int(metrics.set_aside_groups)
        if metrics.executions == 0:
            self._empty_step(updates, metrics)
            return
        self.empty_in_a_row = 0
        if not metrics.grad_norm > 0:
            self.stats["no_signal_steps"] += 1
            why = ("every group's rewards tie" if metrics.tied_groups == 1.0
                   else "every execution was clipped or has advantage 0")  # fmt: skip
            self.rec.event("no_signal", step=updates, reason=why)
            print(f"GYRE-WARNING step {updates} carried no learning signal "
                  f"(grad_norm {metrics.grad_norm:.3g}): {why}", flush=True)  # fmt: skip

    def _empty_step(self, updates: int, metrics: StepMetrics) -> None:
        """A batch with nothing to train skipped its update; too many in a row stop the run."""
        self.stats["empty_steps"] += 1
        self.empty_in_a_row += 1
        why = (f"{metrics.set_aside_groups:.0f} of its groups set aside "
               f"(fewer than train.min_group_outcomes={self.cfg.train.min_group_outcomes} "
               "usable outcomes), the rest only failure placeholders")  # fmt: skip
        self.rec.event("empty_step", step=updates, reason=why)
        print(f"GYRE-WARNING step {updates} had nothing to train and skipped its update: "
              f"{why}", flush=True)  # fmt: skip
        if self.empty_in_a_row >= self.cfg.train.max_empty_batches:
            raise wire.RuntimeFailure(
                f"{self.empty_in_a_row} batches in a row had nothing to train "
                f"(train.max_empty_batches): {self.ledger.why_untrainable()}"
            )

    def line(self, updates: int) -> None:
        """One JSON progress line on stdout (rendered live by `gyre run`): the first of each
        step always (the run's last update included, which the loop ends right after), else
        at most 2 per s."""
        now = time.time()
        if now - self.last_progress < 0.5 and updates == self.last_step:
            return
        self.last_progress, self.last_step = now, updates
        last = self.step_rows[-1].to_row() if self.step_rows else {}
        line = {
            "t": now - self.t0, "step": updates, "steps": self.cfg.steps,
            "waterlevel": self.sched.waterlevel, "roles": [r.value for r in self.sched.roles],
            "version": self.sched.version, "published": self.sched.published,
            "reward": last.get("reward_mean"), "staleness": last.get("staleness_mean"),
            "loss": last.get("loss"), "grad_norm": last.get("grad_norm"),
            "tied_groups": last.get("tied_groups"), **self.stats,
        }  # fmt: skip
        print("GYRE-PROGRESS " + json.dumps(line), flush=True)

    def summary(
        self, run_dir: Path, cell_hosts: list[list[str]] | None, status: int,
        resumed: CheckpointState | None, updates: int,
    ) -> dict[str, Any]:  # fmt: skip
        """The run's `summary.json`."""
        return {
            "run_dir": str(run_dir),
            "policy": self.cfg.schedule.policy,
            "ranks_per_cell": self.cfg.topology.ranks_per_cell,
            "model_family": model_family(self.cfg.model),
            "train_backend": self.cfg.train.backend,
            "train_dtype": self.cfg.train.params_dtype,
            "engine_backend": self.cfg.engine.backend,
            "parallel": dataclasses.asdict(self.cfg.dims),
            "engines_per_cell": self.cfg.engines_per_cell,
            "cell_hosts": cell_hosts,
            "status": status,
            "resumed_from": None
            if resumed is None
            else {"version": resumed.version, "updates": resumed.updates},
            "steps_done": updates,
            "wall_s": time.time() - self.t0,
            "executions": len(self.ledger.executions),
            "switch_s_mean": sum(self.switch_seconds) / max(1, len(self.switch_seconds)),
            "wasted_switches": self.sched.wasted_switches,
            # Elastic: steps whose batch satellites joined (the other policies train on
            # cells fixed for the whole batch: None)
            "satellite_steps": sum(1 for r in self.step_rows if r.train_cells > 1)
            if self.cfg.schedule.policy == "elastic"
            else None,
            **self.stats,
            "policies": self.policies,
            "steps": [r.to_row() for r in self.step_rows],
        }

    def pace(self, run_dir: Path, engine_urls: list[str], wall_s: float) -> dict[str, Any] | None:
        """A paced run's `summary.json` `pace`: the scale, the run's modelled hours, and how
        often real work overran its modelled time, per kind (engine calls: each engine's
        `/gyre/stats`; cell work: the cells' `logs/pace/cell*.json`). None: not paced."""
        pace = self.cfg.pace
        if not pace.enabled:
            return None
        from gyre.errors import EngineError
        from gyre.rollout.client import blocking
        from gyre.rollout.pacing import merged

        calls, lost = [], 0
        for url in engine_urls:
            try:
                stats = blocking(url, lambda client: client.stats(), timeout=10)
            except EngineError:
                lost += 1  # a dead engine's counts died with it
                continue
            if stats.get("pace"):
                calls.append(stats["pace"])
        cells = [
            json.loads(f.read_text())
            for f in sorted((run_dir / "logs" / "pace").glob("cell*.json"))
        ]
        return {
            "scale": pace.scale,
            "paced_h": wall_s * pace.scale / 3600,
            "calls": merged(calls),
            "cell_work": merged(cells),
            "engines_unread": lost,
        }


def paced_line(pace: dict[str, Any]) -> str:
    """What a paced run's numbers are: modelled device time, and where this machine could
    not keep to it (docs/pacing.md)."""
    calls, cells = pace["calls"], pace["cell_work"]
    return (
        f"PACED x{pace['scale']:g}: {pace['paced_h']:.2f} modelled hours (devices took a "
        f"modelled cluster's time, not this machine's); overran the model: "
        f"{calls['overruns']:.0f}/{calls['work']:.0f} calls ({calls['overrun_share']:.1%} of "
        f"their time), {cells['overruns']:.0f}/{cells['work']:.0f} cell work "
        f"({cells['overrun_share']:.1%})"
    )
