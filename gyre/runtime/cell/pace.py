"""A cell's device work held to the modelled cluster's time (`pace:`, docs/pacing.md)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from gyre.rollout.pacing import Pacer
from gyre.runtime.shared.config import RunConfig
from gyre.schedule.devices import PaceConfig
from gyre.train.packing import MicroStep


class Pace:
    """A cell's device work held to the modelled cluster's time (`pace:`, docs/pacing.md).

    Each message's work is timed from `begin` (the message's arrival): a role switch, a
    training pass (a window of micro-steps through the modelled pipeline), the update, a
    publication. Unpaced (`pace.scale` 0), every call returns at once.
    """

    def __init__(self, cfg: PaceConfig, pacer: Pacer | None) -> None:
        self.cfg, self.pacer = cfg, pacer
        self.began = time.monotonic()

    @classmethod
    def of(cls, cfg: RunConfig, report: Path) -> Pace:
        if not cfg.pace.enabled:
            return cls(cfg.pace, None)
        report.parent.mkdir(parents=True, exist_ok=True)
        return cls(cfg.pace, Pacer(cfg.pace.scale, report))

    def begin(self) -> None:
        self.began = time.monotonic()

    def hold(self, modelled_s: float) -> None:
        if self.pacer is not None:
            self.pacer.hold(modelled_s, self.began)

    def switch(self, *, to_train: bool) -> None:
        self.hold(self.cfg.costs.switch_s(to_train))

    def train_pass(self, steps: Sequence[MicroStep], *, prepass: bool) -> None:
        """A pass over a window of micro-steps, 1F1B through the modelled cell's pipeline
        stages (`CostConfig.window_s`, the simulator's charge)."""
        tokens = [sum(row.length for row in step.rows) for step in steps]
        self.hold(self.cfg.costs.window_s(tokens, self.cfg.nodes_per_cell, prepass=prepass))
