"""The learning-rate schedule (`train.lr_schedule`): one function, `OptimConfig.lr_at`.

Checked against a slow, obvious reference (the whole run's learning rates written out as a
list, update by update), against hand-computed values, with hypothesis properties over any
valid schedule (bounds, warmup rising, decay falling, the floor reached at `decay_steps`),
for its one-line config errors, and through a real training step: a `CellTrainer` holding
version k (as a resumed run's does) steps the core's AdamW at `lr_at(k)`.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.train.config import OptimConfig, TrainConfig


def reference_lrs(cfg: OptimConfig, steps: int, length: int) -> list[float]:
    """The learning rates of a run of `steps` updates' first `length` updates, built phase
    by phase: the warmup ramp, the plateau or the cosine's half period, the floor."""
    lrs: list[float] = []
    for i in range(1, cfg.warmup_steps + 1):  # the i-th update of the warmup
        lrs.append(cfg.lr * i / cfg.warmup_steps)
    if cfg.lr_schedule == "cosine":
        end = cfg.decay_steps if cfg.decay_steps is not None else steps
        span = end - cfg.warmup_steps
        for j in range(1, span + 1):  # j updates into the decay
            angle = math.pi * j / span
            lrs.append(cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 + math.cos(angle)) / 2)
        floor = cfg.min_lr
    else:
        floor = cfg.lr
    while len(lrs) < length:
        lrs.append(floor)
    return lrs[:length]


def test_hand_computed_values() -> None:
    warm = OptimConfig(lr=1.0, lr_schedule="linear_warmup", warmup_steps=4)
    assert [warm.lr_at(k, 10) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, min_lr=0.0)
    got = [cos.lr_at(k, 4) for k in range(6)]  # decay_steps null: the run's 4 steps
    assert got == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0, 0.0], abs=1e-12)
    no_warmup = OptimConfig(lr=2.0, lr_schedule="cosine", min_lr=1.0, decay_steps=2)
    assert [no_warmup.lr_at(k, 99) for k in range(3)] == pytest.approx([1.5, 1.0, 1.0])
    assert [OptimConfig(lr=3e-4).lr_at(k, 5) for k in range(7)] == [3e-4] * 7


schedules = st.builds(
    lambda kind, warmup, lr, floor, decay: OptimConfig(
        lr=lr,
        lr_schedule=kind,
        warmup_steps=0 if kind == "constant" else max(warmup, kind == "linear_warmup"),
        min_lr=lr * floor if kind == "cosine" else 0.0,
        decay_steps=None if decay is None or kind != "cosine" else warmup + decay,
    ),
    st.sampled_from(["constant", "linear_warmup", "cosine"]),
    st.integers(0, 20),
    st.floats(1e-7, 1.0),
    st.floats(0.0, 1.0),
    st.none() | st.integers(1, 30),
)


@settings(max_examples=300, deadline=None)
@given(cfg=schedules, steps=st.integers(1, 40))
def test_the_schedule_is_the_reference_and_keeps_its_shape(cfg: OptimConfig, steps: int) -> None:
    length = max(steps, cfg.warmup_steps) + 3
    lrs = [cfg.lr_at(k, steps) for k in range(length)]
    assert lrs == pytest.approx(reference_lrs(cfg, steps, length), rel=1e-12, abs=1e-18)
    assert all(0 <= x <= cfg.lr * (1 + 1e-12) for x in lrs)
    assert all(x > 0 for x in lrs[: cfg.warmup_steps])
    assert all(x >= cfg.min_lr * (1 - 1e-12) for x in lrs[cfg.warmup_steps :])
    ramp = lrs[: cfg.warmup_steps]
    assert all(a < b for a, b in itertools.pairwise(ramp))  # warmup rises
    after = lrs[max(cfg.warmup_steps - 1, 0) :]
    assert all(a >= b * (1 - 1e-12) for a, b in itertools.pairwise(after))  # then never rises
    if cfg.warmup_steps:
        assert lrs[cfg.warmup_steps - 1] == pytest.approx(cfg.lr)  # warmup ends at the peak
    if cfg.lr_schedule == "cosine":
        end = cfg.decay_steps if cfg.decay_steps is not None else steps
        if end > cfg.warmup_steps:  # the floor from update `end` on
            assert lrs[end - 1 :] == pytest.approx([cfg.min_lr] * (length - end + 1), abs=1e-15)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"lr_schedule": "step"}, "lr_schedule: 'step'; allowed constant, linear_warmup, cosine"),
        ({"warmup_steps": 5}, "warmup_steps: 5 with lr_schedule constant; allowed 0"),
        (
            {"lr_schedule": "linear_warmup"},
            "warmup_steps: 0 with lr_schedule linear_warmup; allowed an integer >= 1",
        ),
        (
            {"lr_schedule": "cosine", "warmup_steps": -1},
            "warmup_steps: -1 with lr_schedule cosine; allowed an integer >= 0",
        ),
        (
            {"min_lr": 1e-7},
            "min_lr/decay_steps: 1e-07/None with lr_schedule constant; allowed "
            "only with lr_schedule cosine",
        ),
        (
            {"lr_schedule": "linear_warmup", "warmup_steps": 2, "decay_steps": 9},
            "min_lr/decay_steps: 0.0/9 with lr_schedule linear_warmup",
        ),
        ({"lr_schedule": "cosine", "min_lr": 1.0}, r"min_lr: 1.0; allowed 0 <= min_lr <= lr"),
        ({"lr_schedule": "cosine", "min_lr": -1e-9}, "min_lr: -1e-09; allowed 0 <= min_lr"),
        (
            {"lr_schedule": "cosine", "warmup_steps": 4, "decay_steps": 4},
            r"decay_steps: 4; allowed an integer > warmup_steps \(4\), or null",
        ),
    ],
)
def test_a_bad_schedule_is_one_line_naming_what_is_allowed(keys: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        TrainConfig(**keys)
    assert "\n" not in str(err.value)


def test_the_run_config_reads_the_schedule_keys(tmp_path) -> None:
    from gyre.runtime.shared.config import DEFAULT_CONFIG, load_run_config

    cfg = load_run_config(DEFAULT_CONFIG, ["train.lr_schedule=cosine", "train.warmup_steps=3",
                                           "train.min_lr=1e-5"], steps=12)  # fmt: skip
    assert (cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.min_lr) == (
        "cosine", 3, 1e-5)  # fmt: skip
    assert cfg.train.lr_at(11, cfg.steps) == pytest.approx(1e-5)
    with pytest.raises(ConfigError, match=r"run\.train\.lr_schedule"):
        load_run_config(DEFAULT_CONFIG, ["train.lr_schedule=cosin"])


def _batch(model: torch.nn.Module, version: int):
    """One ready group of 4 executions sampled at random, packed: (micro-steps, batch info)."""
    import numpy as np

    from gyre.train.rewards import ExecutionOutcome, Status
    from gyre.train.stream import ReadyGroup, StreamConfig, StreamPackingBuffer
    from gyre.trajectory.tree import Provenance, TrajectoryTree

    gen = np.random.default_rng(0)
    outcomes, trees = [], {}
    for i in range(4):
        eid = f"e{i}"
        tree = TrajectoryTree(eid)
        tree.add_node(parent_id=0, input_ids=gen.integers(0, 50, 6),
                      input_provenance=np.full(6, Provenance.USER, np.uint8),
                      output_ids=gen.integers(0, 50, 5),
                      output_logprobs=np.full(5, -3.0, np.float32), role="main",
                      policy_version=version, engine_id="t", t_start=0.0, t_end=1.0,
                      finish_reason="stop", input_key=b"i", output_key=b"o")  # fmt: skip
        trees[eid] = tree
        outcomes.append(ExecutionOutcome(execution_id=eid, status=Status.VALID, reward=i / 3))
    buf = StreamPackingBuffer(StreamConfig(groups_per_batch=1, group_size=4, token_budget=512))
    buf.add_ready(ReadyGroup(group_id="g", policy_version=version, outcomes=outcomes,
                             trees=trees))  # fmt: skip
    buf.begin_batch()
    steps = []
    while not buf.closed:
        steps += buf.pull()
    return steps, buf.batch_info()


@pytest.mark.parametrize(("version", "want"), [
    (0, 1e-2 / 4),  # the first of 4 warmup updates
    (7, 1e-4 + (1e-2 - 1e-4) * 0.25),  # the 8th: 4 of the 6 decay updates, cos(2 pi / 3) = -1/2
])  # fmt: skip
def test_a_training_step_uses_the_scheduled_lr_of_the_update_it_makes(
    tmp_path, version: int, want: float
) -> None:
    """The cell trainer's update (the code both backends' cores run) steps AdamW at
    `lr_at(version)`: at a run's first update, and at update 7 of a trainer that holds
    version 7 — a resumed run's, whose schedule continues there, not from its start."""
    from gyre.runtime.cell.trainer import CellTrainer
    from gyre.runtime.shared import messages as msg
    from gyre.runtime.shared.config import DEFAULT_CONFIG, load_run_config
    from gyre.train.cell import CoreOptimizer, TorchCell
    from gyre.train.comm import Communicators
    from gyre.train.objective import batch_gradient, execution_scalars

    cfg = load_run_config(DEFAULT_CONFIG, ["train.lr_schedule=cosine", "train.warmup_steps=4",
                                           "train.lr=1e-2", "train.min_lr=1e-4"], steps=10)  # fmt: skip
    replica = cfg.train_backend.build(cfg.model, cfg.train, cfg.dims, core=True, device="cpu")
    twin = TorchCell(copy.deepcopy(replica.cell.model), objective=cfg.train.objective)
    trainer = CellTrainer(cfg, replica, Communicators.alone(cell_id=0), None, version=version,
                          run_dir=tmp_path)  # fmt: skip
    steps, info = _batch(replica.cell.model, version)
    sums: dict[str, float] = {}
    for step in steps:
        for eid, value in (trainer.prepass(msg.Prepass(0, version, (step,))) or [{}])[0].items():
            sums[eid] = sums.get(eid, 0.0) + value
    scalars = execution_scalars(sums, info.executions, cfg.train.objective)
    for step in steps:
        trainer.accumulate(msg.Accumulate(0, version, (step,), scalars))
    grad = batch_gradient(replica.cell.flat_grads.clone(), info.num_executions)
    trainer.reduce(msg.Reduce(batch=0, cells=1, num_executions=info.num_executions))

    assert reference_lrs(cfg.train, cfg.steps, 10)[version] == pytest.approx(want)
    assert replica.optimizer is not None
    assert replica.optimizer.opt.param_groups[0]["lr"] == pytest.approx(want)
    for lr, same in ((want, True), (cfg.train.lr, False)):
        ref = TorchCell(copy.deepcopy(twin.model), objective=cfg.train.objective)
        CoreOptimizer(ref, cfg.train.optim).step(grad, lr=lr)
        assert torch.equal(ref.flat_params, replica.cell.flat_params) is same, lr
