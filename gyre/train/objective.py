"""The execution-level GSPO adaptation (derivation and definitions: docs/objective.md).

For execution i with admitted, deduplicated targets T_i (L_i = |T_i|), advantage A_i, behaviour
log-probs b_t (recorded by the rollout engine) and current log-probs l_t = log pi_theta:

    token log-ratio     d_t   = l_t - b_t
    sequence log-ratio  S_i   = (1 / L_i) * sum_{t in T_i} d_t        s_i = exp(S_i)
    execution gate      g_i   = 0 if (A_i > 0 and s_i > clip_high) or (A_i < 0 and s_i < clip_low)
                                else 1                                    (GSPO's min/clip)
    token weight        rho_t = min(exp(d_t), cap)  (held constant)       cap = 5
    gradient            grad J = (1/E) * sum_i (g_i * A_i / L_i) * sum_{t in T_i} rho_t * grad l_t

The loss a micro-step backpropagates is `-sum_t c_t * l_t` with the detached coefficient
`c_t = g_i * A_i * rho_t / L_i`; the core multiplies the batch's summed gradient by 1/E
(`batch_gradient`), since E is known only once the batch closes. g_i couples all rows of an execution, so it is computed
in a no-grad *prepass* over the whole batch first (phase A, `ratio_sums` per micro-step, summed
per execution), then every micro-step's backward (phase B) is independent: gradient sums are
the same for any split of rows into micro-steps and any assignment of micro-steps to cells.

`token_weight="sequence_ratio"` uses rho_t = s_i instead, which is exactly GSPO's gradient
(Zheng et al., 2025) with our execution-level sequences and normalization.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gyre.errors import TrainingError
from gyre.train.config import ObjectiveConfig
from gyre.train.packing import MicroStep


@dataclass(frozen=True, slots=True)
class ExecutionScalar:
    """What phase B needs per execution: advantage, target count, sequence ratio and gate."""

    advantage: float
    num_targets: int  # L_i
    log_ratio: float  # S_i
    gate: float  # g_i in {0, 1}


@dataclass(slots=True)
class StepTensors:
    """A micro-step as padded tensors."""

    ids: torch.Tensor  # int64 [n, T]
    attention: torch.Tensor  # int64 [n, T] (1 = real token)
    targets: torch.Tensor  # bool [n, T]
    behaviour: torch.Tensor  # float64 [n, T] (0 off-target)
    executions: list[str]  # execution id per row


def step_tensors(step: MicroStep, device: str | torch.device = "cpu") -> StepTensors:
    """Right-padded tensors of a micro-step."""
    if not step.rows:
        raise TrainingError(f"micro-step {step.index}: has no rows")
    n, width = len(step.rows), max(r.length for r in step.rows)
    ids = np.zeros((n, width), np.int64)
    att = np.zeros((n, width), np.int64)
    tgt = np.zeros((n, width), bool)
    beh = np.zeros((n, width), np.float64)
    for k, r in enumerate(step.rows):
        ids[k, : r.length], att[k, : r.length], tgt[k, : r.length] = r.ids, 1, r.targets
        beh[k, : r.length] = np.where(r.targets, r.behaviour_logprobs, 0.0)
    return StepTensors(
        ids=torch.from_numpy(ids).to(device),
        attention=torch.from_numpy(att).to(device),
        targets=torch.from_numpy(tgt).to(device),
        behaviour=torch.from_numpy(beh).to(device),
        executions=[r.execution_id for r in step.rows],
    )


def target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log pi(ids[:, t] | ids[:, :t]) for t >= 1 (column 0 is 0), in the logits' dtype."""
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def check_finite(logp: torch.Tensor, st: StepTensors, where: str) -> None:
    """Raise `TrainingError` if the policy produced non-finite log-probs at a target."""
    if not torch.isfinite(logp[st.targets]).all():
        raise TrainingError(f"{where}: current-policy log-probs at targets are not finite")


def ratio_sums(logp: torch.Tensor, st: StepTensors) -> dict[str, float]:
    """Phase A: sum over this micro-step's targets of (l_t - b_t), per execution (float64)."""
    d = (logp.detach().double() - st.behaviour) * st.targets
    per_row = d.sum(dim=1).tolist()
    out: dict[str, float] = {}
    for eid, v in zip(st.executions, per_row):
        out[eid] = out.get(eid, 0.0) + v
    return out


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


def token_coefficients(
    logp: torch.Tensor,
    st: StepTensors,
    scalars: Mapping[str, ExecutionScalar],
    cfg: ObjectiveConfig,
) -> torch.Tensor:
    """Detached c_t = g_i A_i rho_t / L_i at targets, 0 elsewhere (float64 [n, T]).

    The batch factor 1/E is not in c_t: E is final only when the batch closes, so the core
    divides the summed gradient by E before clipping (`batch_gradient`).
    """
    rows = [scalars[e] for e in st.executions]
    dev = st.behaviour.device
    per_row = torch.tensor(
        [s.gate * s.advantage / s.num_targets for s in rows], dtype=torch.float64, device=dev
    )
    if cfg.token_weight == "sequence_ratio":
        rho = torch.tensor([math.exp(s.log_ratio) for s in rows], dtype=torch.float64, device=dev)
        rho = rho[:, None].expand_as(st.behaviour)
    else:
        d = logp.detach().double() - st.behaviour
        rho = torch.exp(d.clamp(max=math.log(cfg.token_weight_cap)))
    return torch.where(st.targets, per_row[:, None] * rho, torch.zeros_like(rho))


def batch_gradient(summed: torch.Tensor, num_executions: int) -> torch.Tensor:
    """grad J: the micro-steps' summed gradient times 1/E (a new tensor)."""
    if num_executions < 1:
        raise TrainingError(f"num_executions: {num_executions}; a batch needs >= 1 execution")
    return summed / num_executions


def step_loss(logp: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """The micro-step's loss: -sum c_t l_t (its gradient is -grad J restricted to the step)."""
    return -(coeff.to(logp.dtype) * logp).sum()
