"""Paced cells (docs/pacing.md): a cell holds each piece of device work to the modelled
cluster's time — switches, training passes with one pipeline fill per batch, updates — by
the cost model the simulator uses; the `pace` section is checked like every other."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from gyre.errors import ConfigError
from gyre.rollout.pacing import Pacer
from gyre.runtime.cell.pace import Pace
from gyre.runtime.shared.config import load_run_config
from gyre.schedule.devices import CostConfig, PaceConfig
from gyre.train.packing import MicroStep, TokenRow

from .conftest import small_config, write_config


def _step(index: int, lengths: list[int]) -> MicroStep:
    rows = []
    for n in lengths:
        targets = np.zeros(n, dtype=bool)
        targets[-1] = True
        rows.append(TokenRow(
            execution_id=f"x{n}", group_id="g0", policy_version=0,
            ids=np.arange(n, dtype=np.int64), targets=targets,
            behaviour_logprobs=np.where(targets, -1.0, 0.0), advantage=1.0,
            execution_targets=1, weights=targets / 1.0,
        ))  # fmt: skip
    return MicroStep(index=index, rows=tuple(rows))


def test_a_cell_holds_switches_and_windows_through_its_pipeline() -> None:
    costs = CostConfig(switch_to_train_s=10, switch_to_rollout_s=4, update_s=3,
                       pipeline_stages=3, train_tokens_per_node_s=100, prepass_ratio=0.5)  # fmt: skip
    cfg = PaceConfig(scale=100, nodes_per_cell=2, costs=costs)
    pace = Pace(cfg, Pacer(cfg.scale))
    assert pace.pacer is not None
    t0 = time.monotonic()
    held = []
    for work in (
        lambda: pace.switch(to_train=True),  # 10 s
        # a window through 3 stages (gyre.schedule.pipeline): one micro-step crosses all 3
        lambda: pace.train_pass([_step(0, [300, 100])], prepass=True),  # 1 s a stage: 3
        # 2 s and 1 s, forward = backward (prepass_ratio 0.5): stage 0 F0 F1 ... ends at 6.5
        lambda: pace.train_pass([_step(0, [300, 100]), _step(1, [200])], prepass=False),
        lambda: pace.train_pass([_step(0, [200])], prepass=False),  # 1 s a stage: 3
        lambda: pace.hold(costs.update_s),  # 3 s
        lambda: pace.switch(to_train=False),  # 4 s
    ):
        before = pace.pacer.stats.modelled_s
        pace.begin()
        work()
        held.append(round((pace.pacer.stats.modelled_s - before) * cfg.scale, 6))
    assert held == [10, 3, 6.5, 3, 3, 4]
    assert time.monotonic() - t0 >= sum(held) / cfg.scale
    assert pace.pacer.stats.overruns == 0


def test_an_unpaced_cell_holds_nothing() -> None:
    pace = Pace(PaceConfig(), None)
    t0 = time.monotonic()
    pace.begin()
    pace.switch(to_train=True)
    pace.train_pass([_step(0, [10_000])], prepass=False)
    assert time.monotonic() - t0 < 0.05


def test_the_pace_section_is_checked(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    path = write_config(tmp_path, cfg)
    got = load_run_config(path, ["pace.scale=600", "pace.costs.publish_s=90"])
    assert got.pace.enabled and got.pace.costs.publish_s == 90
    assert not load_run_config(path).pace.enabled  # off unless asked for
    with pytest.raises(ConfigError, match=r"scale: -1.*allowed: 0 \(off\) or > 0"):
        load_run_config(path, ["pace.scale=-1"])
    with pytest.raises(ConfigError, match=r"pace: unknown key 'speed'"):
        load_run_config(path, ["pace.speed=2"])
    with pytest.raises(ConfigError, match=r"pacing the embedded engine only"):
        load_run_config(path, ["pace.scale=10", "engine.backend=sglang"])


def test_a_paced_run_warns_when_its_modelled_stages_are_not_its_own(tmp_path: Path) -> None:
    """The scheduler sizes windows for the cells' own pipeline stages; a paced pass is charged
    through the modelled cluster's (`pace.costs.pipeline_stages`): where they differ, said."""
    path = write_config(tmp_path, small_config(tmp_path))
    pp2 = ["train.backend=megatron", "topology.ranks_per_cell=2", "train.parallel.pipeline=2"]

    def paced(*overrides: str) -> list[str]:
        cfg = load_run_config(path, ["pace.scale=600", *overrides])
        return [w for w in cfg.warnings() if w.startswith("pace.")]

    assert paced() == [] and paced(*pp2, "pace.costs.pipeline_stages=2") == []
    assert paced(*pp2) == [
        "pace.costs.pipeline_stages 1 != train.parallel.pipeline 2: the cells claim windows "
        "of 4 micro-steps for their 2 stages, but a paced pass is charged through 1"
    ]
    assert not [w for w in load_run_config(path, pp2).warnings() if w.startswith("pace.")]
