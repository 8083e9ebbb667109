"""Online cost estimates and the cost-aware join rule of the scheduler.

The scheduler keeps no clock, so it cannot time anything itself: the driver (the runtime's
coordinator, or the simulator) measures how long a cell's role switch and each micro-step
pass took and sends the seconds with `SwitchDone` / `MicroStepDone`. `CostEstimates` turns
those into running estimates, starting from the priors of `Config`:

* switch seconds per cell and direction (to TRAIN, to ROLLOUT); a cell that has not switched
  yet in that direction uses the estimate pooled over all cells, and the prior before any;
* seconds per micro-step pass per kind (PREPASS, GRADIENT), pooled over the cells.

Each estimate is the prior until its first measurement, which replaces it; later ones move it
by `cost_smoothing` (an exponential average, so a drifting cost is followed).

`join_pays` is the rule a satellite must pass, beside the paper's Eq. 6, before it leaves
rollout for the open batch (docs/scheduler.md, "Cost-aware joins").
"""

from __future__ import annotations

import math

from gyre.errors import SchedulerError
from gyre.schedule.config import Config
from gyre.schedule.events import Work
from gyre.vocabulary import Role


class Estimate:
    """A running estimate of one cost, in seconds."""

    __slots__ = ("count", "value")

    def __init__(self, prior: float) -> None:
        self.value = prior
        self.count = 0

    def add(self, seconds: float, weight: float) -> None:
        self.value = seconds if self.count == 0 else self.value + weight * (seconds - self.value)
        self.count += 1


class CostEstimates:
    """Switch seconds per cell and direction, pass seconds per kind, from measured events."""

    def __init__(self, config: Config) -> None:
        self.weight = config.cost_smoothing
        priors = {Role.TRAIN: config.switch_to_train_prior_s,
                  Role.ROLLOUT: config.switch_to_rollout_prior_s}  # fmt: skip
        self.switch_pooled = {role: Estimate(p) for role, p in priors.items()}
        self.switch_cell = {
            role: [Estimate(p) for _ in range(config.cells)] for role, p in priors.items()
        }
        self.prepass = Estimate(config.prepass_prior_s)
        self.gradient = Estimate(config.gradient_prior_s)

    def switched(self, cell: int, to: Role, seconds: float | None) -> None:
        """Record cell's switch to `to` (TRAIN or ROLLOUT) that took `seconds`."""
        if seconds is None:
            return
        _check("SwitchDone", seconds)
        self.switch_cell[to][cell].add(seconds, self.weight)
        self.switch_pooled[to].add(seconds, self.weight)

    def passed(self, work: Work, seconds: float | None) -> None:
        """Record one micro-step pass of kind `work` that took `seconds`."""
        if seconds is None:
            return
        _check("MicroStepDone", seconds)
        (self.prepass if work is Work.PREPASS else self.gradient).add(seconds, self.weight)

    def switch_s(self, cell: int, to: Role) -> float:
        """Expected seconds of cell's next switch to `to`."""
        own = self.switch_cell[to][cell]
        return own.value if own.count else self.switch_pooled[to].value

    def pass_s(self, work: Work) -> float:
        """Expected seconds of one pass of kind `work`."""
        return (self.prepass if work is Work.PREPASS else self.gradient).value


def join_pays(
    *, work_s: float, microsteps: float, trainers: int, joining: int, switch_in_s: float,
    switch_out_s: float, chain_s: float, payback: float,
) -> bool:  # fmt: skip
    """The cost-aware join rule (docs/scheduler.md, "Cost-aware joins"):

        M − n·(1 + s_in / t_c)  ≥  u                       (a micro-step is left to start)
        W − n·s_in  ≥  payback · (n + u) · (s_in + s_out)   (its share pays its round trip)

    W (`work_s`) is the open batch's unclaimed work in seconds, in M (`microsteps`) micro-steps
    nobody started; n (`trainers`) cells are training or switching to it, the unit has u
    (`joining`) cells with expected switch seconds s_in / s_out, and t_c (`chain_s`) is one
    micro-step's prepass plus gradient pass. While the unit switches, the n trainers start a
    micro-step each and one more per t_c, and do n·s_in seconds of the work; what is left is
    shared by n + u cells, and the unit's share must cover its round trip `payback` times.
    """
    started = trainers * (1 + switch_in_s / chain_s) if chain_s > 0 else math.inf
    left = work_s - trainers * switch_in_s
    pays = left >= payback * (trainers + joining) * (switch_in_s + switch_out_s)
    return microsteps - started >= joining and pays and left > 0


def _check(what: str, seconds: float) -> None:
    if not (0 <= seconds < math.inf):
        raise SchedulerError(f"{what}: seconds {seconds!r}; allowed: a finite number >= 0")
