"""Materialization, execution weighting, micro-step packing and the stream packing buffer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import TrainingError
from gyre.train.admission import AdmissionConfig, AdmissionTree, admit
from gyre.train.packing import make_row, materialize_execution, oversize, pack_rows
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.train.stream import ReadyGroup, StreamConfig, StreamPackingBuffer
from gyre.train.synthetic import branching_tree
from gyre.trajectory.tree import Provenance, TrajectoryTree

VOCAB = 4096


def _rows_of(tree: TrajectoryTree, j_max: int | None, seed: int = 0, adv: float = 1.0):
    picked = admit(AdmissionTree.from_tree(tree), config=AdmissionConfig(j_max=j_max), seed=seed)
    return picked, materialize_execution(
        tree, picked, advantage=adv, group_id="g", policy_version=0
    )


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 3, None]))
def test_materialized_targets_are_policy_tokens_disjoint_and_weighted(seed: int, j_max) -> None:
    tree = branching_tree(np.random.default_rng(seed), "x", vocab=VOCAB, subagents=2, scale=3)
    picked, rows = _rows_of(tree, j_max, seed)
    total = sum(a.num_targets for a in picked)
    claimed: set[tuple[int, int]] = set()
    for a, row in zip(picked, rows):
        pt = tree.materialize(a.leaf)
        assert np.array_equal(row.ids, pt.ids)  # the recorded context, unchanged
        assert not (row.targets & (pt.provenance != Provenance.POLICY)).any()
        assert np.isfinite(row.behaviour_logprobs[row.targets]).all()
        # token identity: (node, offset within the node's stored tokens)
        starts = {n: int(np.argmax(pt.node_of_token == n)) for n in set(pt.node_of_token.tolist())}
        ident = {
            (int(n), i - starts[int(n)]) for i, n in enumerate(pt.node_of_token) if row.targets[i]
        }
        assert not claimed & ident
        claimed |= ident
        assert row.execution_targets == total
    assert sum(r.num_targets for r in rows) == total
    assert sum(float(r.weights.sum()) for r in rows) == pytest.approx(1.0)


def _node(tree: TrajectoryTree, parent: int, n_in: int, n_out: int, role: str = "main") -> int:
    k = len(tree)
    return tree.add_node(
        parent_id=parent, input_ids=np.arange(n_in) % VOCAB,
        input_provenance=np.full(n_in, Provenance.TOOL, np.uint8),
        output_ids=np.arange(n_out) % VOCAB, output_logprobs=np.full(n_out, -1.0, np.float32),
        role=role, policy_version=0, engine_id="e", t_start=0.0, t_end=1.0,
        finish_reason="stop", input_key=f"i{k}".encode(), output_key=f"o{k}".encode(),
    ).node_id  # fmt: skip


def test_ten_paths_and_one_path_with_equal_targets_carry_equal_weight() -> None:
    wide = TrajectoryTree("wide")
    root = _node(wide, 0, 5, 10)
    for _ in range(10):
        _node(wide, root, 3, 9, role="subagent")
    chain = TrajectoryTree("chain")
    _node(chain, _node(chain, 0, 5, 40), 7, 60)
    for tree in (wide, chain):
        _picked, rows = _rows_of(tree, None)
        assert rows[0].execution_targets == 100
        assert sum(float(r.weights.sum()) for r in rows) == pytest.approx(1.0)
    assert len(_rows_of(wide, None)[1]) == 10 and len(_rows_of(chain, None)[1]) == 1
    # in the objective: same advantage, on-policy (rho = 1) -> each execution's coefficients
    # sum to A / E, whatever its number of paths
    import torch

    from gyre.train.objective import (
        ObjectiveConfig,
        execution_scalars,
        ratio_sums,
        step_tensors,
        token_coefficients,
    )
    from gyre.train.packing import MicroStep

    rows = _rows_of(wide, None)[1] + _rows_of(chain, None)[1]
    st_ = step_tensors(MicroStep(index=0, rows=tuple(rows)))
    logp = st_.behaviour.clone()
    info = {"wide": (0.7, 100), "chain": (0.7, 100)}
    sc = execution_scalars(ratio_sums(logp, st_), info, ObjectiveConfig())
    coeff = token_coefficients(logp, st_, sc, ObjectiveConfig()) / 2
    per_exec = {e: float(coeff[k].sum()) for k, e in enumerate(st_.executions)}
    totals = {e: sum(float(coeff[k].sum()) for k, x in enumerate(st_.executions) if x == e)
              for e in per_exec}  # fmt: skip
    assert totals["wide"] == pytest.approx(0.35) and totals["chain"] == pytest.approx(0.35)
    assert torch.count_nonzero(coeff) == 200


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 260), min_size=1, max_size=30), st.integers(50, 200))
def test_pack_rows_respects_budget_and_keeps_every_row(lengths: list[int], budget: int) -> None:
    rows = [
        make_row(execution_id=f"e{i}", group_id="g", policy_version=0, ids=np.zeros(n, int),
                 targets=np.arange(n) == n - 1, behaviour_logprobs=np.zeros(n), advantage=0.5,
                 execution_targets=1)
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    steps = pack_rows(rows, token_budget=budget)
    # a step is within the budget, or holds one row longer than the budget, alone
    assert all(s.padded_tokens <= budget or len(s.rows) == 1 for s in steps)
    alone = [s.rows[0].length for s in steps if s.padded_tokens > budget]
    assert sorted(alone) == sorted(n for n in lengths if n > budget)
    assert oversize(rows, budget) == len(alone)
    flat = [r for s in steps for r in s.rows]
    assert sorted(id(r) for r in flat) == sorted(id(r) for r in rows)
    assert [r.length for r in flat] == sorted(lengths, reverse=True)  # length-balanced order
    assert [s.index for s in steps] == list(range(len(steps)))


def test_bad_rows_are_errors() -> None:
    kw = dict(execution_id="e", group_id="g", policy_version=0, ids=np.zeros(4, int),
              advantage=1.0, execution_targets=2)  # fmt: skip
    with pytest.raises(TrainingError, match="finite"):
        make_row(**kw, targets=[0, 1, 1, 0], behaviour_logprobs=[0, np.nan, -1, 0])
    with pytest.raises(TrainingError, match="position 0"):
        make_row(**kw, targets=[1, 1, 0, 0], behaviour_logprobs=np.zeros(4))
    with pytest.raises(TrainingError, match="no targets"):
        make_row(**kw, targets=[0, 0, 0, 0], behaviour_logprobs=np.zeros(4))
    row = make_row(**kw, targets=[0, 1, 1, 0], behaviour_logprobs=np.zeros(4))
    with pytest.raises(TrainingError, match="token_budget: 0"):
        pack_rows([row], token_budget=0)


def _group(gid: str, version: int, rewards: list[float | None], seed: int) -> ReadyGroup:
    outs, trees = [], {}
    for i, r in enumerate(rewards):
        eid = f"{gid}-e{i}"
        if r is None:
            outs.append(ExecutionOutcome(execution_id=eid, status=Status.PLACEHOLDER))
            continue
        outs.append(ExecutionOutcome(execution_id=eid, status=Status.VALID, reward=r))
        trees[eid] = branching_tree(np.random.default_rng(seed + i), eid, vocab=VOCAB, scale=3)
    return ReadyGroup(group_id=gid, policy_version=version, outcomes=outs, trees=trees)


def test_stream_buffer_pulls_oldest_version_and_closes_after_b_groups() -> None:
    cfg = StreamConfig(groups_per_batch=2, group_size=3, token_budget=400)
    buf = StreamPackingBuffer(cfg)
    buf.add_ready(_group("new", 5, [1.0, 0.0, 1.0], 0))
    buf.add_ready(_group("old", 3, [1.0, None, 0.0], 10))
    buf.add_ready(_group("mid", 4, [0.0, 1.0, 1.0], 20))
    steps = buf.pull()
    assert not buf.closed and buf.batch_info().group_ids == ["old"]
    steps += buf.pull()
    assert buf.closed and buf.batch_info().group_ids == ["old", "mid"]
    assert buf.pull() == [] and buf.ready_groups == 1
    info = buf.batch_info()
    assert info.num_executions == 5  # the placeholder has no targets and does not count
    rows = [r for s in steps for r in s.rows]
    assert {r.execution_id for r in rows} == set(info.executions)
    assert [s.index for s in steps] == list(range(len(steps)))
    assert all(s.padded_tokens <= 400 for s in steps)
    for eid, (_, n) in info.executions.items():
        assert sum(r.num_targets for r in rows if r.execution_id == eid) == n


def test_stream_buffer_rejects_bad_groups() -> None:
    buf = StreamPackingBuffer(StreamConfig(groups_per_batch=1, group_size=2, token_budget=400))
    bad = _group("g", 0, [1.0, 0.0], 0)
    bad.outcomes[1] = ExecutionOutcome(execution_id="g-e1", status=Status.VALID, reward=None)
    with pytest.raises(TrainingError, match="finite reward"):
        buf.add_ready(bad)
    pending = _group("p", 0, [1.0, 0.0], 0)
    pending.outcomes[0] = ExecutionOutcome(execution_id="p-e0", status=Status.PENDING)
    with pytest.raises(TrainingError, match="not ready"):
        buf.add_ready(pending)
    assert buf.ready_groups == 0


def test_a_batch_with_nothing_to_train_closes_empty() -> None:
    """Only failure placeholders: the batch closes with no micro-step and E = 0 (the update is
    skipped), and the next batch trains as usual."""
    buf = StreamPackingBuffer(StreamConfig(groups_per_batch=1, group_size=2, token_budget=400))
    buf.add_ready(_group("empty", 0, [None, None], 0))
    assert buf.pull() == [] and buf.closed
    assert buf.batch_info().num_executions == 0 and buf.batch_info().group_ids == ["empty"]
    buf.begin_batch()
    buf.add_ready(_group("next", 1, [1.0, 0.0], 3))
    assert buf.pull() and buf.closed and buf.batch_info().num_executions == 2


OUTCOME = st.sampled_from([Status.VALID, Status.PLACEHOLDER, Status.EXCLUDED])


@settings(max_examples=120, deadline=None)
@given(
    groups=st.lists(st.lists(OUTCOME, min_size=3, max_size=3), min_size=1, max_size=4),
    min_outcomes=st.integers(1, 3),
    seed=st.integers(0, 5),
)
def test_groups_with_too_few_usable_outcomes_are_set_aside(
    groups: list[list[Status]], min_outcomes: int, seed: int
) -> None:
    """Against the obvious rule: a group trains iff at least `min_outcomes` of its outcomes
    are usable (VALID or PLACEHOLDER); a set-aside group fills its slot and adds no row, and
    the batch always closes (empty when nothing is left to train)."""
    cfg = StreamConfig(groups_per_batch=len(groups), group_size=3, token_budget=4000,
                       min_outcomes=min_outcomes)  # fmt: skip
    buf = StreamPackingBuffer(cfg)
    rng = np.random.default_rng(seed)
    for g, statuses in enumerate(groups):
        outs, trees = [], {}
        for i, status in enumerate(statuses):
            eid = f"g{g}-e{i}"
            reward = float(rng.integers(0, 2)) if status is Status.VALID else None
            outs.append(ExecutionOutcome(execution_id=eid, status=status, reward=reward))
            if status is Status.VALID:
                trees[eid] = branching_tree(rng, eid, vocab=VOCAB, scale=1)
        buf.add_ready(ReadyGroup(group_id=f"g{g}", policy_version=0, outcomes=outs, trees=trees))
    steps = []
    while not buf.closed:
        steps += buf.pull()
    info = buf.batch_info()
    usable = {f"g{g}": sum(s is not Status.EXCLUDED for s in st_) for g, st_ in enumerate(groups)}
    assert info.set_aside == [g for g in info.group_ids if usable[g] < min_outcomes]
    assert len(info.group_ids) == len(groups)
    trained = {r.execution_id.split("-")[0] for step in steps for r in step.rows}
    assert trained <= {g for g in usable if usable[g] >= min_outcomes}
    expected = {f"g{g}-e{i}" for g, st_ in enumerate(groups) if usable[f"g{g}"] >= min_outcomes
                for i, s in enumerate(st_) if s is Status.VALID}  # fmt: skip
    assert set(info.executions) == expected
