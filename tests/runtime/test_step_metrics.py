"""The numbers a researcher watches per step (issue 52, item 4), on a small known batch.

The coordinator's `TrainingPlane` (the one implementation of the batch protocol) is driven
by hand — two groups of two executions, known trees, known prepass sums — and its step
metrics are checked against values computed here: importance weights (the executions'
sequence ratios), the clip fraction, response length and turns per execution, reward per
task, training throughput; then the step row's tracker tags (`train/`, `rollout/`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gyre.runtime.coordinator.progress import StepMetrics, tags
from gyre.runtime.coordinator.training import TrainingPlane
from gyre.runtime.shared import messages as msg
from gyre.schedule.events import Work
from gyre.train.config import TrainConfig
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.trajectory.tree import Provenance, TrajectoryTree


def _tree(eid: str, outputs: list[int]) -> TrajectoryTree:
    """A chain of calls, each 4 user tokens then `outputs[i]` sampled tokens."""
    tree = TrajectoryTree(eid)
    for i, n in enumerate(outputs):
        tree.add_node(
            parent_id=i, input_ids=np.arange(10, 14), input_provenance=np.full(4, Provenance.USER),
            output_ids=np.arange(20, 20 + n), output_logprobs=np.full(n, -1.0, np.float32),
            role="main", policy_version=0, engine_id="e0", t_start=1.0, t_end=2.0,
            finish_reason="stop", input_key=b"i%d" % i, output_key=b"o%d" % i,
        )  # fmt: skip
    return tree


# execution -> (group, task, reward, calls' sampled tokens, sequence log-ratio S_i)
BATCH = {
    "g0-e0": ("g0", "add", 1.0, [3, 2], 0.01),  # A > 0, ratio e^0.01 > clip_high: clipped
    "g0-e1": ("g0", "add", 0.0, [4], -0.001),  # A < 0, ratio e^-0.001 >= clip_low: kept
    "g1-e0": ("g1", "fizzbuzz", 0.5, [1, 1, 1], 0.0),
    "g1-e1": ("g1", "fizzbuzz", 0.25, [6], -0.01),  # A < 0, e^-0.01 < clip_low: clipped
}


def _run_batch() -> TrainingPlane:
    sent: list[msg.Message] = []
    plane = TrainingPlane(TrainConfig(), groups_per_batch=2, group_size=2,
                          send=lambda _, m: sent.append(m))  # fmt: skip
    plane.begin(0, 0)
    for group, task in (("g0", "add"), ("g1", "fizzbuzz")):
        mine = {e: x for e, x in BATCH.items() if x[0] == group}
        outcomes = [ExecutionOutcome(execution_id=e, status=Status.VALID, reward=x[2])
                    for e, x in mine.items()]  # fmt: skip
        trees = {e: _tree(e, x[3]) for e, x in mine.items()}
        plane.admit(group, 0, 1, outcomes, trees, task=task)
    while plane.prepass_queue:
        plane.claim(0, Work.PREPASS)
        (step,) = sent.pop().steps  # type: ignore[attr-defined]
        sums = {}
        for row in step.rows:  # sum_t (l_t - b_t) = S_i * L_i, spread over rows by targets
            eid = row.execution_id
            sums[eid] = sums.get(eid, 0.0) + BATCH[eid][4] * row.num_targets
        plane.prepassed(msg.Prepassed(cell=0, batch=0, indices=(step.index,), sums=(sums,),
                                      seconds=0.1))  # fmt: skip
    while plane.gradient_queue:
        plane.claim(0, Work.GRADIENT)
        (step,) = sent.pop().steps  # type: ignore[attr-defined]
        plane.accumulated(msg.Accumulated(cell=0, batch=0, indices=(step.index,), objective=0.5,
                                          targets=step.num_targets, seconds=0.2))  # fmt: skip
    plane.update((0,))
    plane.updated(msg.Updated(cell=0, batch=0, grad_norm=0.7, seconds=0.3))
    return plane


def test_the_step_metrics_of_a_known_batch() -> None:
    plane = _run_batch()
    got = plane.metrics()
    ratios = [math.exp(x[4]) for x in BATCH.values()]
    assert got["ratio_mean"] == pytest.approx(sum(ratios) / 4, rel=1e-9)
    assert got["ratio_max"] == pytest.approx(math.exp(0.01), rel=1e-9)
    assert got["gated_executions"] == 0.5  # the clip fraction: g0-e0 and g1-e1
    assert got["response_tokens_mean"] == (5 + 4 + 3 + 6) / 4
    assert got["turns_mean"] == (2 + 1 + 3 + 1) / 4
    assert got["reward_mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.25) / 4)
    assert got["grad_norm"] == 0.7 and got["staleness_mean"] == 1.0
    assert plane.task_rewards() == {"add": 0.5, "fizzbuzz": 0.375}
    rows = [r for s in plane.steps.values() for r in s.rows]
    tokens = sum(r.length for r in rows)  # each path's prompt and sampled tokens
    assert tokens == sum(4 * len(x[3]) + sum(x[3]) for x in BATCH.values())
    assert got["train_tokens_per_s"] == pytest.approx(tokens / got["train_wall_s"])


def test_the_step_row_and_its_tracker_tags() -> None:
    plane = _run_batch()
    metrics = StepMetrics(
        **plane.metrics(), lr=1e-3, train_cells=1.0, step_s=2.0, rollout_tokens_per_s=9.0,
        duration_s=1.5, elapsed_s=3.0, task_rewards=plane.task_rewards(),
    )  # fmt: skip
    row = metrics.to_row()
    assert row["reward/add"] == 0.5 and row["reward/fizzbuzz"] == 0.375
    tagged = tags(row)
    assert len(tagged) == len(row)
    assert tagged["rollout/reward/add"] == 0.5 and tagged["rollout/reward_mean"] == row[
        "reward_mean"]  # fmt: skip
    assert tagged["rollout/response_tokens_mean"] == 4.5 and tagged["rollout/turns_mean"] == 1.75
    assert tagged["rollout/rollout_tokens_per_s"] == 9.0
    for name in ("loss", "grad_norm", "gated_executions", "ratio_mean", "ratio_max", "lr",
                 "train_tokens_per_s", "step_s"):  # fmt: skip
        assert tagged[f"train/{name}"] == row[name], name
    assert all(k.startswith(("train/", "rollout/")) for k in tagged)
