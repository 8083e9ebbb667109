"""Every message between the ranks of a Gyre job: one frozen dataclass per kind.

The coordinator (rank 0) talks to the proxy node (rank 1) and to the cells (ranks 2..) —
nobody else talks to anybody. A message travels up (to the coordinator) or down (from it);
`gyre.runtime.shared.wire` pickles these objects over one TCP connection per rank and each
receiver dispatches on the type, so a reader can follow a message by its name from the
sender to its one handler. Each connection keeps its messages in order, which the
protocol relies on (a `HarnessEnded` always precedes its `Assessed`).

Fields carry Gyre's own types where they have one: a harness `Outcome`, a cell `Role`, a
`VerdictRecord` (the evaluator's verdict with its assessments). Engines travel by their
string id ("e3", `gyre.vocabulary.EngineId`), the name the proxy routes by.

`table()` renders the message table of docs/runtime.md (a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from gyre.vocabulary import Outcome, Role, VerdictStatus

if TYPE_CHECKING:
    from gyre.tasks.evaluator import Assessment
    from gyre.tasks.scoring import TestVerdict

PROXY, CELL, COORDINATOR, JUDGE = "proxy node", "cell", "coordinator", "judge engine"


@dataclass(frozen=True, slots=True)
class VerdictRecord:
    """An execution's verdict as the coordinator records it: status, reward, why, when.

    `assessments` are the evaluator's records of every attempt, written to the trace's
    `assessments` table; `error` says why there is no valid score. `tests`:
    a repository task's per-test outcomes behind the reward (`Verdict.tests`), written to
    the execution's meta; empty for other tasks and when there is no valid score.
    """

    status: VerdictStatus
    reward: float | None  # None iff excluded
    t: float  # unix seconds the verdict was reached
    error: str = ""
    assessments: tuple[Assessment, ...] = ()
    tests: tuple[TestVerdict, ...] = ()

    @property
    def usable(self) -> bool:
        """Whether the execution's reward may enter advantage estimation."""
        return self.status is not VerdictStatus.EXCLUDED

    @classmethod
    def excluded(cls, error: str, t: float) -> VerdictRecord:
        """No valid score, and why (the evaluator crashed, the execution never ran, ...)."""
        return cls(status=VerdictStatus.EXCLUDED, reward=None, t=t, error=error)


@dataclass(frozen=True)
class Message:
    """Base of every message; `up` says its direction, `route` who sends it to whom."""

    up: ClassVar[bool]
    route: ClassVar[tuple[str, str]]


# ------------------------------------------------------------------ proxy node -> coordinator


@dataclass(frozen=True)
class ProxyReady(Message):
    """The proxy serves harnesses at `url`; groups are drawn from `tasks` of its suite."""

    up, route = True, (PROXY, COORDINATOR)
    url: str
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class Drained(Message):
    """The proxy starts no new call at `engine` and routes its executions elsewhere."""

    up, route = True, (PROXY, COORDINATOR)
    engine: str


@dataclass(frozen=True)
class HarnessEnded(Message):
    """An execution's harness ended: completed, failed, timed out or cancelled."""

    up, route = True, (PROXY, COORDINATOR)
    execution: int
    outcome: Outcome
    t_launch: float | None
    t_end: float
    reason: str


@dataclass(frozen=True)
class JournalNode(Message):
    """One model call of a running execution, as recorded: the coordinator journals it."""

    up, route = True, (PROXY, COORDINATOR)
    execution_id: str
    node: Any


@dataclass(frozen=True)
class Assessed(Message):
    """An execution closed (its tree is its journaled nodes) with the evaluator's verdict."""

    up, route = True, (PROXY, COORDINATOR)
    execution: int
    verdict: VerdictRecord
    errors: int


@dataclass(frozen=True)
class Evaluated(Message):
    """An in-run evaluation's held-out executions are scored: rewards, who served, samples."""

    up, route = True, (PROXY, COORDINATOR)
    step: int  # the step it was due at (the policy version published when it began)
    rewards: dict[str, float | None]  # execution id -> reward (None: excluded)
    versions: tuple[int, ...]  # policy versions that served its calls
    engines: tuple[str, ...]  # engines that served them
    t_start: float
    t_end: float
    samples: dict[str, Any] = field(default_factory=dict)  # execution id -> transcript


@dataclass(frozen=True)
class StartupTimes(Message):
    """A rank's start-up: seconds per phase from `gyre run`'s start until the rank served."""

    up, route = True, (f"{PROXY}, {CELL}", COORDINATOR)
    rank: int
    component: str  # "proxy", "cell0" (a leader), "cell0.1" (its rank 1), "standalone0"
    phases: dict[str, float]  # in order (gyre.runtime.shared.startup.StartupClock)


# ------------------------------------------------------------------ cell -> coordinator


@dataclass(frozen=True)
class EngineReady(Message):
    """Engine `engine` serves at `url` with weights of policy `version` (start or restart)."""

    up, route = True, (CELL, COORDINATOR)
    engine: int
    url: str
    version: int


@dataclass(frozen=True)
class JudgeReady(Message):
    """Judge engine `judge` serves the initial model at `url` (again after a restart)."""

    up, route = True, (JUDGE, COORDINATOR)
    judge: int
    url: str


@dataclass(frozen=True)
class EngineLost(Message):
    """Engine `engine`'s process exited (`returncode`, negative: killed by that signal)."""

    up, route = True, (CELL, COORDINATOR)
    engine: int
    returncode: int


@dataclass(frozen=True)
class Switched(Message):
    """Cell `cell` finished its switch to `role` (train or rollout) in `seconds`."""

    up, route = True, (CELL, COORDINATOR)
    cell: int
    role: Role  # TRAIN or ROLLOUT
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)  # where the time went; KV moved


@dataclass(frozen=True)
class Prepassed(Message):
    """The prepass of a window of micro-steps (`indices`): per micro-step, per-execution sums
    of l_t - b_t over its targets."""

    up, route = True, (CELL, COORDINATOR)
    cell: int
    batch: int
    indices: tuple[int, ...]
    sums: tuple[dict[str, float], ...]
    seconds: float


@dataclass(frozen=True)
class Accumulated(Message):
    """The gradient pass of a window of micro-steps (`indices`) added into the cell's
    gradient buffer; their objective and targets summed."""

    up, route = True, (CELL, COORDINATOR)
    cell: int
    batch: int
    indices: tuple[int, ...]
    objective: float
    targets: int
    seconds: float


@dataclass(frozen=True)
class Updated(Message):
    """Cell `cell` took part in the update of `batch`; the core reports the gradient norm."""

    up, route = True, (CELL, COORDINATOR)
    cell: int
    batch: int
    grad_norm: float | None
    seconds: float


@dataclass(frozen=True)
class Published(Message):
    """The core pushed `version` to the rollout engines; `missed` ones did not take it."""

    up, route = True, (CELL, COORDINATOR)
    version: int
    seconds: float
    missed: list[int]


@dataclass(frozen=True)
class PolicySaved(Message):
    """The core wrote policy `version` as a Hugging Face model directory at `path`."""

    up, route = True, (CELL, COORDINATOR)
    version: int
    path: str


@dataclass(frozen=True)
class Checkpointed(Message):
    """The core saved its weights and optimizer state at `version` into `folder`."""

    up, route = True, (CELL, COORDINATOR)
    version: int
    folder: str
    bytes: int
    seconds: float


# ------------------------------------------------------------------ coordinator -> proxy node


@dataclass(frozen=True)
class SetEngines(Message):
    """Engine id -> URL: engines to add (or whose URL changed after a restart)."""

    up, route = False, (COORDINATOR, PROXY)
    urls: dict[str, str]


@dataclass(frozen=True)
class SetJudges(Message):
    """The judge engines' URLs: the judge rule asks them when a task names no endpoint."""

    up, route = False, (COORDINATOR, PROXY)
    urls: list[str]


@dataclass(frozen=True)
class Drain(Message):
    """Start no new call at `engine`; route these executions to new engines; ack if asked."""

    up, route = False, (COORDINATOR, PROXY)
    engine: str
    routes: dict[str, str]
    ack: bool


@dataclass(frozen=True)
class Undrain(Message):
    """`engine` serves again (its cell is back in rollout)."""

    up, route = False, (COORDINATOR, PROXY)
    engine: str


@dataclass(frozen=True)
class StartExecution(Message):
    """Run one execution of `task` (instance `instance`), its calls routed to `engine`."""

    up, route = False, (COORDINATOR, PROXY)
    execution: int
    execution_id: str
    task: str
    instance: int
    engine: str


@dataclass(frozen=True)
class Rescore(Message):
    """Score the preserved workspace of an execution a dead job left running (a resume)."""

    up, route = False, (COORDINATOR, PROXY)
    execution: int
    execution_id: str
    task: str
    instance: int
    tree: Any = None  # its journaled TrajectoryTree: the transcript a rule may read


@dataclass(frozen=True)
class Evaluate(Message):
    """Run the held-out set (`eval:`) on the rollout engines, as evaluation executions."""

    up, route = False, (COORDINATOR, PROXY)
    step: int
    engine: str | None = None  # route every call here; None: any live engine


@dataclass(frozen=True)
class Cancel(Message):
    """Cancel these executions' harnesses (they are still closed, scored and reported)."""

    up, route = False, (COORDINATOR, PROXY)
    execution_ids: list[str]


@dataclass(frozen=True)
class Stop(Message):
    """Leave with exit status `status` (to the proxy node and every cell)."""

    up, route = False, (COORDINATOR, f"{PROXY}, {CELL}")
    status: int


# ------------------------------------------------------------------ coordinator -> cell


@dataclass(frozen=True)
class ToTrain(Message):
    """Hand running calls' KV to their new engines, abort, release; the replica trains."""

    up, route = False, (COORDINATOR, CELL)
    routes: dict[str, str] = field(default_factory=dict)  # execution -> new engine's URL


@dataclass(frozen=True)
class ToRollout(Message):
    """Resume the engine; load the replica's weights into it if older than `published`."""

    up, route = False, (COORDINATOR, CELL)
    published: int


@dataclass(frozen=True)
class Prepass(Message):
    """No-grad forward of a window of micro-steps, `steps`, at the weights of `version` (pull
    them first if behind)."""

    up, route = False, (COORDINATOR, CELL)
    batch: int
    version: int
    steps: tuple[Any, ...]


@dataclass(frozen=True)
class Accumulate(Message):
    """Forward + backward of a window of micro-steps, `steps`, with their executions'
    scalars, at `version`."""

    up, route = False, (COORDINATOR, CELL)
    batch: int
    version: int
    steps: tuple[Any, ...]
    scalars: dict[str, Any]


@dataclass(frozen=True)
class Reduce(Message):
    """Sum gradients of cells 0..cells-1 at the core, scale by 1/E, clip, step, broadcast."""

    up, route = False, (COORDINATOR, CELL)
    batch: int
    cells: int
    num_executions: int


@dataclass(frozen=True)
class Publish(Message):
    """Core: push policy `version` to these (engine, url) targets; keep it as a policy.

    Sent to every rank of the core cell: each rank sends the part of the weights it holds
    (`gyre.runtime.cell.publication`)."""

    up, route = False, (COORDINATOR, CELL)
    version: int
    targets: list[tuple[int, str]]


@dataclass(frozen=True)
class SavePolicy(Message):
    """Core: write the current weights as policy directory `name` (e.g. "final").

    Sent to every rank of the core cell: each rank writes the part of the weights it holds
    (`gyre.runtime.shared.policies.save_parts`)."""

    up, route = False, (COORDINATOR, CELL)
    name: str


@dataclass(frozen=True)
class Respawn(Message):
    """Restart the lost engine with the latest policy; released again unless `role` is rollout."""

    up, route = False, (COORDINATOR, CELL)
    role: Role


@dataclass(frozen=True)
class Reload(Message):
    """Load the latest published policy into the engine if it missed it."""

    up, route = False, (COORDINATOR, CELL)


@dataclass(frozen=True)
class SaveCheckpoint(Message):
    """Core: save weights and optimizer state into the checkpoint directory `folder`."""

    up, route = False, (COORDINATOR, CELL)
    folder: str


ALL: tuple[type[Message], ...] = tuple(
    cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Message) and cls is not Message
)


def fields(cls: type[Message]) -> list[str]:
    """The message's field names, in order."""
    return [f.name for f in dataclasses.fields(cls)]


def table() -> str:
    """The markdown message table of docs/runtime.md."""
    lines = ["| message | from → to | fields | meaning |", "|---|---|---|---|"]
    for cls in ALL:
        sender, receiver = cls.route
        names = ", ".join(fields(cls)) or "—"
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines.append(f"| `{cls.__name__}` | {sender} → {receiver} | {names} | {doc} |")
    return "\n".join(lines)
