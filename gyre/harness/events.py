"""Events the harness runner reports to the coordinator: an execution launched, terminated.

Small frozen dataclasses, safe to pass across asyncio tasks and to pickle between ranks. The
runner emits `Launched` once the harness process exists and exactly one `Terminated` per
execution (also when the harness never started: setup failure, command not found).
`Terminated` is also what `HarnessRunner.run` returns and what the evaluator consumes; its
`Outcome` is the shared one of `gyre.vocabulary`, which the scheduler counts as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.vocabulary import Outcome


@dataclass(frozen=True, slots=True)
class Launched:
    """The harness process of an execution started."""

    execution_id: str
    pid: int
    t: float  # unix seconds
    workspace: str
    sandbox: str  # "none" | "bwrap"


@dataclass(frozen=True, slots=True)
class Terminated:
    """An execution's harness ended (or never started); its workspace is preserved."""

    execution_id: str
    outcome: Outcome
    reason: str  # human-readable cause ("" when completed normally)
    returncode: int | None  # None when no process ran
    t: float  # unix seconds of termination
    t_launch: float | None  # unix seconds of launch; None when no process ran
    deadline: float  # end of the overall budget (harness + evaluation), unix seconds
    workspace: str | None  # preserved workspace, None when setup failed
    stdout_path: str | None
    stderr_path: str | None
    # False when there is no assessable work (setup failed, harness never started)
    assessable: bool = True


HarnessEvent = Launched | Terminated
