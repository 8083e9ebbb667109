"""Materialization of admitted trajectories into token rows, and packing rows into micro-steps.

A `TokenRow` is one admitted trajectory: its full recorded context (`ids`, exactly the tokens
the engine saw, in path order), a target mask (the tokens fixed at admission; token t is
predicted from positions < t, so position 0 is never a target), the behaviour log-probs the
rollout engine recorded, the execution id, the execution's advantage and per-token loss
weights `1 / L_i` on targets (L_i = the execution's admitted, deduplicated target count). The
batch factor `1 / E` (E = executions contributing targets to the batch) is applied once the
batch is closed (see docs/objective.md), because streaming emits rows before E is known.

`pack_rows` orders rows by length (longest first) and fills micro-steps greedily so that a
micro-step's padded size `rows x longest row` stays within `token_budget`: neighbouring rows
have similar lengths, so padding is small and micro-steps carry similar work.

    rows = materialize_execution(tree, admitted, advantage=a, group_id="g0", policy_version=3)
    steps = pack_rows(rows, token_budget=8192)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre.errors import TrainingError
from gyre.train.admission import Admitted


@dataclass(kw_only=True, slots=True, eq=False)
class TokenRow:
    """One admitted trajectory, ready for a forward pass."""

    execution_id: str
    group_id: str
    policy_version: int
    ids: np.ndarray  # int64 [T]: the recorded context, path order
    targets: np.ndarray  # bool [T]: admitted targets of this row
    behaviour_logprobs: np.ndarray  # float64 [T]: engine log-probs (finite at targets)
    advantage: float  # the execution's group-relative advantage
    execution_targets: int  # L_i: targets of the whole execution (all its rows)
    weights: np.ndarray  # float64 [T]: 1 / L_i at targets, 0 elsewhere
    routing: np.ndarray | None = None
    # int16 [T, layers, top_k]: the experts the rollout engine routed each position to (-1
    # unknown), replayed by a MoE trainer (`PathTokens.routing`); None: none recorded

    def __post_init__(self) -> None:
        validate_row(self)

    @property
    def length(self) -> int:
        """Tokens in the row."""
        return len(self.ids)

    @property
    def num_targets(self) -> int:
        """Targets in the row."""
        return int(self.targets.sum())


def validate_row(row: TokenRow) -> None:
    """Raise `TrainingError` naming what is wrong with a row."""
    where = f"row of execution {row.execution_id!r}"
    n = len(row.ids)
    if row.ids.ndim != 1 or n == 0:
        raise TrainingError(f"{where}: ids must be a non-empty 1-D array")
    for name in ("targets", "behaviour_logprobs", "weights"):
        if getattr(row, name).shape != (n,):
            raise TrainingError(f"{where}: {name} shape {getattr(row, name).shape} != ({n},)")
    if row.targets.dtype != np.bool_:
        raise TrainingError(f"{where}: targets must be a bool mask")
    if row.targets[0]:
        raise TrainingError(f"{where}: position 0 cannot be a target (it has no context)")
    if not row.targets.any():
        raise TrainingError(f"{where}: no targets; rows without targets must not be emitted")
    if not np.isfinite(row.behaviour_logprobs[row.targets]).all():
        raise TrainingError(f"{where}: behaviour log-probs at targets must be finite (NaN/inf)")
    if not math.isfinite(row.advantage):
        raise TrainingError(f"{where}: advantage {row.advantage!r} is not finite")
    if row.execution_targets < row.num_targets:
        raise TrainingError(f"{where}: execution_targets {row.execution_targets} < row targets")
    if row.routing is not None and (row.routing.ndim != 3 or len(row.routing) != n):
        raise TrainingError(f"{where}: routing shape {row.routing.shape} != ({n}, layers, top_k)")


def make_row(
    *,
    execution_id: str,
    group_id: str,
    policy_version: int,
    ids: Any,
    targets: Any,
    behaviour_logprobs: Any,
    advantage: float,
    execution_targets: int,
    routing: np.ndarray | None = None,
) -> TokenRow:
    """A validated row with weights 1 / execution_targets on its targets."""
    t = np.asarray(targets, dtype=bool)
    if execution_targets < 1:
        raise TrainingError(f"execution {execution_id!r}: execution_targets must be >= 1")
    return TokenRow(
        execution_id=execution_id,
        group_id=group_id,
        policy_version=int(policy_version),
        ids=np.asarray(ids, dtype=np.int64),
        targets=t,
        behaviour_logprobs=np.asarray(behaviour_logprobs, dtype=np.float64),
        advantage=float(advantage),
        execution_targets=int(execution_targets),
        weights=np.where(t, 1.0 / execution_targets, 0.0),
        routing=routing,
    )


def materialize_execution(
    tree: Any, admitted: Sequence[Admitted], *, advantage: float, group_id: str, policy_version: int
) -> list[TokenRow]:
    """Rows of one execution's admitted trajectories (targets fixed at admission)."""
    total = sum(a.num_targets for a in admitted)
    rows: list[TokenRow] = []
    for a in admitted:
        pt = tree.materialize(a.leaf)
        targets = pt.trainable & np.isin(pt.node_of_token, np.asarray(a.target_nodes))
        if int(targets.sum()) != a.num_targets:
            raise TrainingError(
                f"execution {tree.execution_id!r}: leaf {a.leaf} has {int(targets.sum())} "
                f"targets in the tree, admission fixed {a.num_targets}"
            )
        rows.append(
            make_row(
                execution_id=tree.execution_id,
                group_id=group_id,
                policy_version=policy_version,
                ids=pt.ids,
                targets=targets,
                behaviour_logprobs=pt.logprobs,
                advantage=advantage,
                execution_targets=total,
                routing=pt.routing,
            )
        )
    return rows


@dataclass(kw_only=True, slots=True, eq=False)
class MicroStep:
    """Rows one cell processes in one forward-backward."""

    index: int
    rows: tuple[TokenRow, ...]

    @property
    def padded_tokens(self) -> int:
        """Size of the padded batch: rows x longest row."""
        return len(self.rows) * max(r.length for r in self.rows)

    @property
    def num_targets(self) -> int:
        """Targets in the micro-step."""
        return sum(r.num_targets for r in self.rows)


def step_routing(step: MicroStep, width: int) -> np.ndarray | None:
    """A micro-step's recorded routing `[rows, width, layers, top_k]` (-1 where unknown and
    on padding to `width`), from its rows' `TokenRow.routing`, for a MoE trainer to replay;
    None when no row has any."""
    rows = [r.routing for r in step.rows]
    shapes = {r.shape[1:] for r in rows if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise TrainingError(f"micro-step {step.index}: rows routed with shapes {sorted(shapes)}")
    (shape,) = shapes
    out = np.full((len(rows), width, *shape), -1, np.int64)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, : len(r)] = r
    return out


def balance_order(rows: Iterable[TokenRow]) -> list[TokenRow]:
    """Rows longest first (stable), so neighbours have similar lengths."""
    return sorted(rows, key=lambda r: -r.length)


def pack_rows(
    rows: Sequence[TokenRow], *, token_budget: int, first_index: int = 0
) -> list[MicroStep]:
    """Greedy packing of length-ordered rows into micro-steps of <= token_budget padded tokens.

    A row longer than the budget (a path of an xLong execution) trains in a micro-step of its
    own, as long as it is: never split (its targets need their whole context), never an
    error (`oversize` counts them)."""
    if token_budget < 1:
        raise TrainingError(f"token_budget: {token_budget}; allowed an int >= 1")
    steps: list[MicroStep] = []
    current: list[TokenRow] = []
    for row in balance_order(rows):
        if row.length > token_budget:  # longest first: these come before any packed step
            steps.append(MicroStep(index=first_index + len(steps), rows=(row,)))
            continue
        width = max([row.length] + [r.length for r in current])
        if current and (len(current) + 1) * width > token_budget:
            steps.append(MicroStep(index=first_index + len(steps), rows=tuple(current)))
            current = []
        current.append(row)
    if current:
        steps.append(MicroStep(index=first_index + len(steps), rows=tuple(current)))
    return steps


def oversize(rows: Iterable[TokenRow], token_budget: int) -> int:
    """How many rows are longer than the micro-step budget (each trains alone)."""
    return sum(1 for r in rows if r.length > token_budget)
