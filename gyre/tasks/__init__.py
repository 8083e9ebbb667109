"""Tasks, task suites and the evaluator that scores preserved workspaces (paper §5.2).

    from gyre.tasks import builtin_suite, Evaluator
    suite = builtin_suite()
    verdict = await Evaluator().assess(terminated, suite["fizzbuzz"])

See docs/tasks.md for the suite format and the scoring semantics.
"""

from typing import TYPE_CHECKING

from gyre.lazy import lazy_exports

if TYPE_CHECKING:
    from gyre.tasks.evaluator import (
        Assessment,
        AssessmentLog,
        Evaluator,
        Validity,
        Verdict,
        feedback_text,
    )
    from gyre.tasks.scoring import RULES, EvaluatorError, Score
    from gyre.tasks.snapshot import freeze, snapshot_id
    from gyre.tasks.suite import Task, TaskSuite, ToolLatency, builtin_suite, load_suite
    from gyre.vocabulary import EVALUATOR_HEADERS

# imported on first use: a harness process needs only `suite` (its tool latency)
__getattr__, __dir__ = lazy_exports(globals(), {
    **dict.fromkeys(("Assessment", "AssessmentLog", "Evaluator", "Validity", "Verdict",
                     "feedback_text"), "gyre.tasks.evaluator"),
    "EVALUATOR_HEADERS": "gyre.vocabulary",
    **dict.fromkeys(("RULES", "EvaluatorError", "Score"), "gyre.tasks.scoring"),
    **dict.fromkeys(("freeze", "snapshot_id"), "gyre.tasks.snapshot"),
    **dict.fromkeys(("Task", "TaskSuite", "ToolLatency", "builtin_suite", "load_suite"),
                    "gyre.tasks.suite"),
})  # fmt: skip

__all__ = [
    "EVALUATOR_HEADERS",
    "RULES",
    "Assessment",
    "AssessmentLog",
    "Evaluator",
    "EvaluatorError",
    "Score",
    "Task",
    "TaskSuite",
    "ToolLatency",
    "Validity",
    "Verdict",
    "builtin_suite",
    "feedback_text",
    "freeze",
    "load_suite",
    "snapshot_id",
]
