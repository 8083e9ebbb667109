"""Events the scheduler consumes and actions it emits.

The scheduler (`gyre.schedule.machine.Scheduler`) is a pure state machine: the real
coordinator and the simulator feed it these small frozen events and carry out the actions it
returns (starting and cancelling harnesses, switching cells, moving model calls, training
micro-steps, publishing weights). A termination's `Outcome` and a cell's `Role` are the
shared enums of `gyre.vocabulary`. Ids are plain integers so the same objects travel between
ranks unchanged: execution `x` belongs to group `x // (N + k)` (k: oversampling, 0 by
default); engines `0..K-1` are the cells' rollout engines and `K..K+S-1` the standalone
engines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gyre.vocabulary import Outcome, Role


class Work(enum.Enum):
    """The two passes over a micro-step (docs/training.md): a claim names one of them."""

    PREPASS = "prepass"  # no-grad forward: the step's per-execution log-ratio sums
    GRADIENT = "gradient"  # forward + backward, once every execution in the step is summed


# ---------------------------------------------------------------- events (driver -> scheduler)


@dataclass(frozen=True, slots=True)
class Start:
    """The job is up: fill the dispatch queue to (φ+μ)B groups and start launching.

    A resumed job brings the groups it had dispatched and not yet trained, already ready:
    `carried` holds their dispatch versions. They become groups 0..c-1, ready at once (their
    executions count as dispatched, launched and terminated), keep their versions for
    staleness, and take their queue slots: only (φ+μ)B - c new groups are dispatched.
    """

    carried: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Launched:
    """Optional confirmation that a `Launch` started its harness (no counter changes)."""

    execution: int


@dataclass(frozen=True, slots=True)
class Terminated:
    """An execution ended (completion, failure, timeout or cancellation): f += 1."""

    execution: int
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class GroupReady:
    """Shorthand for a driver that knows no validity: every execution of the group has
    terminated; settle each one not settled yet as valid, in id order (`Assessed`)."""

    group: int


@dataclass(frozen=True, slots=True)
class Assessed:
    """A terminated execution's outcome settled: `valid` (a score or a failure placeholder,
    usable by training) or excluded (no valid score: evaluator crash, overall budget, ...).

    A group is ready once N of its executions settled valid, or all N + k settled
    (`gyre.schedule.groups`); a surplus execution may settle after that (no effect).
    """

    execution: int
    valid: bool


@dataclass(frozen=True, slots=True)
class MicroStepsQueued:
    """The packing buffer materialized an admitted group into `count` micro-steps."""

    batch: int
    group: int
    count: int


@dataclass(frozen=True, slots=True)
class GradientsReady:
    """`count` more micro-steps of `batch` may have their gradient pass claimed.

    A micro-step's gradient needs the sequence ratio of every execution it holds rows of, so
    it becomes ready once all of those executions' micro-steps finished their prepass.
    """

    batch: int
    count: int


@dataclass(frozen=True, slots=True)
class MicroStepDone:
    """A training cell finished the micro-step pass (the window of them) it claimed.

    `seconds`, when the driver measured it, is the cell's compute time of that pass; the
    scheduler keeps a running estimate per kind of pass from it (cost-aware joins).
    """

    cell: int
    batch: int
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class BatchDone:
    """The core applied the optimizer update of `batch`: the policy version advances."""

    batch: int


@dataclass(frozen=True, slots=True)
class SwitchDone:
    """A cell finished its role transition (TO_TRAIN -> TRAIN or TO_ROLLOUT -> ROLLOUT).

    `seconds`, when the driver measured it, is the whole transition from the `SwitchCell`
    action to this event (drain and reroute included): the time the cell was lost to both
    roles. The scheduler keeps a running estimate per cell and direction from it.
    """

    cell: int
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class WeightsPublished:
    """The core's weights of `version` reached every rollout engine."""

    version: int


@dataclass(frozen=True, slots=True)
class EngineLost:
    """Engine `engine`'s process died: it takes no launch and no reroute until restored.

    Its running executions are moved to open engines while there are free slots (Reroute
    actions); the rest stay on it nominally (their calls are retried elsewhere by the
    proxy anyway). Its concurrency leaves C_R, so the waterlevel checks see the loss.
    """

    engine: int


@dataclass(frozen=True, slots=True)
class EngineRestored:
    """Engine `engine` runs again (restarted): it takes launches and reroutes again."""

    engine: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed (seconds); the scheduler re-evaluates its conditions and keeps no clock."""

    time: float


Event = (
    Start
    | Launched
    | Terminated
    | Assessed
    | GroupReady
    | MicroStepsQueued
    | GradientsReady
    | MicroStepDone
    | BatchDone
    | SwitchDone
    | WeightsPublished
    | EngineLost
    | EngineRestored
    | Tick
)


# --------------------------------------------------------------- actions (scheduler -> driver)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A new group enters the rollout queue; `version` is the published version at dispatch."""

    group: int
    executions: tuple[int, ...]
    version: int


@dataclass(frozen=True, slots=True)
class Launch:
    """Start an execution's harness, its model calls routed to `engine`."""

    execution: int
    engine: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a surplus execution (its group has its N members); answer with `Terminated`
    (outcome CANCELLED, or whatever it ended with first)."""

    execution: int


@dataclass(frozen=True, slots=True)
class Withdraw:
    """A surplus execution still queued when its group completed never launches: it left the
    queue (counted launched and terminated at once, so d - p stays the queue); no answer."""

    execution: int


@dataclass(frozen=True, slots=True)
class SwitchCell:
    """Move a cell toward `role` (TRAIN or ROLLOUT); answer with `SwitchDone`."""

    cell: int
    role: Role


@dataclass(frozen=True, slots=True)
class Reroute:
    """Cancel the execution's calls on `source` and retry them on `destination` (reserved)."""

    execution: int
    source: int
    destination: int


@dataclass(frozen=True, slots=True)
class OpenJoinWindow:
    """Satellites may join `batch` from now on."""

    batch: int


@dataclass(frozen=True, slots=True)
class CloseJoinWindow:
    """No satellite joins `batch` any more (always before its optimizer update)."""

    batch: int


@dataclass(frozen=True, slots=True)
class AdmitGroup:
    """The packing buffer takes a ready group into `batch`; d = v_t - v_d is its staleness.

    `members`: the N executions whose outcomes train, ascending (`groups.trained_members`);
    () for a group a resumed job carried in (its driver's records say which)."""

    group: int
    batch: int
    staleness: int
    members: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimMicroStep:
    """`cell` claims the next `count` micro-step passes `work` of `batch` (a window, run as one
    pass); answer with one `MicroStepDone`.

    A GRADIENT claim goes only to a cell of the training prefix 0..m-1 (its gradient must
    reach the core over the prefix communicator); any training cell may claim a PREPASS.
    """

    cell: int
    batch: int
    work: Work
    count: int = 1


@dataclass(frozen=True, slots=True)
class OptimizerUpdate:
    """Sum the gradients of `cells` (a prefix 0..m-1) at the core, scale by 1/E, clip, update
    once and broadcast; answer with `BatchDone`."""

    batch: int
    cells: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Publish:
    """The core publishes `version` to the rollout `engines`; answer with `WeightsPublished`."""

    version: int
    engines: tuple[int, ...]


Action = (
    Dispatch
    | Launch
    | Cancel
    | Withdraw
    | SwitchCell
    | Reroute
    | OpenJoinWindow
    | CloseJoinWindow
    | AdmitGroup
    | ClaimMicroStep
    | OptimizerUpdate
    | Publish
)
