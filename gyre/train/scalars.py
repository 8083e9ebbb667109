"""The execution-level scalars of the objective, without torch (docs/objective.md).

The coordinator computes each execution's gate from the batch's summed log-ratios between
the prepass and the micro-steps' backward (`execution_scalars`); it does not import torch, so
these live apart from the tensor code in `gyre.train.objective`, which re-exports them:

    sums = merge_sums([ratio_sums_of_each_micro_step, ...])
    scalars = execution_scalars(sums, {execution_id: (advantage, L_i)}, objective_config)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gyre.errors import TrainingError
from gyre.train.config import ObjectiveConfig


@dataclass(frozen=True, slots=True)
class ExecutionScalar:
    """What phase B needs per execution: advantage, target count, sequence ratio and gate."""

    advantage: float
    num_targets: int  # L_i
    log_ratio: float  # S_i
    gate: float  # g_i in {0, 1}


def merge_sums(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per-execution totals of several micro-steps' `ratio_sums` (summed in sorted key order)."""
    out: dict[str, float] = {}
    for part in parts:
        for eid in sorted(part):
            out[eid] = out.get(eid, 0.0) + part[eid]
    return out


def execution_gate(advantage: float, log_ratio: float, cfg: ObjectiveConfig) -> float:
    """GSPO's min/clip on the sequence ratio, as a 0/1 gradient gate."""
    s = math.exp(log_ratio) if log_ratio < 700 else math.inf
    if advantage > 0 and s > cfg.clip_high:
        return 0.0
    if advantage < 0 and s < cfg.clip_low:
        return 0.0
    return 1.0


def execution_scalars(
    sums: Mapping[str, float],
    info: Mapping[str, tuple[float, int]],
    cfg: ObjectiveConfig,
) -> dict[str, ExecutionScalar]:
    """Scalars per execution from the batch's summed log-ratios and (advantage, L_i)."""
    missing = sorted(set(info) - set(sums))
    if missing:
        raise TrainingError(f"prepass: no log-ratio sums for executions {missing}")
    out: dict[str, ExecutionScalar] = {}
    for eid, (adv, n) in info.items():
        s = sums[eid] / n
        if not math.isfinite(s):
            raise TrainingError(f"execution {eid!r}: sequence log-ratio is not finite")
        out[eid] = ExecutionScalar(
            advantage=adv, num_targets=n, log_ratio=s, gate=execution_gate(adv, s, cfg)
        )
    return out
