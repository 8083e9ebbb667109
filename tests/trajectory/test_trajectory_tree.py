"""Trajectory tree: matching, branching, leaves, materialization and stats against slow references."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trajectory_strategies import make_tree, trees

from gyre.errors import GyreError
from gyre.trajectory.tree import Provenance, TrajectoryTree, TreeError, tree_diff, trees_equal


def call(tree: TrajectoryTree, parent: int, new_in: list[int], out: list[int], key: bytes, **kw):
    args = dict(
        parent_id=parent,
        input_ids=new_in,
        input_provenance=[Provenance.USER] * len(new_in),
        output_ids=out,
        output_logprobs=[-0.5] * len(out),
        role="main",
        policy_version=3,
        engine_id="e0",
        t_start=1.0,
        t_end=2.0,
        finish_reason="stop",
        input_key=b"in" + key,
        output_key=key,
    )
    args.update(kw)
    return tree.add_node(**args)


# -- slow obvious references -------------------------------------------------------------------


def ref_path(tree: TrajectoryTree, nid: int) -> list[int]:
    return [] if nid == 0 else [*ref_path(tree, tree.node(nid).parent_id), nid]


def ref_full(tree: TrajectoryTree, nid: int) -> list[tuple[int, int, float, int]]:
    """(id, provenance, logprob-or-nan, node) for every token through nid's output."""
    rows: list[tuple[int, int, float, int]] = []
    for p in ref_path(tree, nid):
        n = tree.node(p)
        rows += [(int(t), int(v), float("nan"), p) for t, v in zip(n.input_ids, n.input_provenance)]
        rows += [(int(t), 0, float(lp), p) for t, lp in zip(n.output_ids, n.output_logprobs)]
    return rows


@settings(max_examples=60, deadline=None)
@given(trees())
def test_paths_context_and_materialize_match_reference(tree: TrajectoryTree) -> None:
    parents = {n.parent_id for n in tree.nodes}
    assert tree.leaves() == [n.node_id for n in tree.nodes if n.node_id not in parents]
    for n in tree.nodes:
        assert tree.path(n.node_id) == ref_path(tree, n.node_id)
        ref = ref_full(tree, n.node_id)
        ctx = [r[0] for r in ref][: len(ref) - len(n.output_ids)]
        assert tree.context_ids(n.node_id).tolist() == ctx
        assert tree.context_ids(n.node_id).dtype == np.int32
        m = tree.materialize(n.node_id)
        assert m.ids.tolist() == [r[0] for r in ref]
        assert m.provenance.tolist() == [r[1] for r in ref]
        np.testing.assert_array_equal(m.logprobs, np.array([r[2] for r in ref], np.float32))
        assert m.node_of_token.tolist() == [r[3] for r in ref]
        assert m.trainable.tolist() == [r[1] == 0 for r in ref]
        assert tree.path_length(n.node_id) == len(ref)
        assert tree.children(n.node_id) == [
            c.node_id for c in tree.nodes if c.parent_id == n.node_id
        ]


@settings(max_examples=60, deadline=None)
@given(trees())
def test_stats_equal_flat_expansion(tree: TrajectoryTree) -> None:
    s = tree.stats()
    flat = [tree.materialize(leaf) for leaf in tree.leaves()]
    assert s.num_nodes == len(tree.nodes)
    assert s.num_leaves == len(flat)
    assert s.flat_tokens == sum(len(m.ids) for m in flat)
    assert s.flat_policy_tokens == sum(int(m.trainable.sum()) for m in flat)
    assert s.unique_tokens == sum(len(n.input_ids) + len(n.output_ids) for n in tree.nodes)
    assert s.unique_policy_tokens == sum(len(n.output_ids) for n in tree.nodes)


@settings(max_examples=60, deadline=None)
@given(trees())
def test_dict_round_trip_through_json_is_exact(tree: TrajectoryTree) -> None:
    back = TrajectoryTree.from_dict(json.loads(json.dumps(tree.to_dict(), allow_nan=False)))
    assert tree_diff(tree, back) == []
    assert back == tree


def test_matching_reuses_prefix_branches_and_attaches_unmatched_to_root() -> None:
    tree = TrajectoryTree("x")
    a = call(tree, 0, [1, 2, 3], [10, 11], b"A")
    # the harness continues A's conversation: the proxy finds A by its chain key
    hit = tree.deepest_match([b"h", b"?", b"A", b"not-yet"])
    assert hit == (2, a)
    b = call(tree, a.node_id, [4], [12], b"B")
    # a compaction request diverges from A's path: a second child of A (a branch)
    c = call(tree, a.node_id, [5, 6], [13], b"C", role="compaction")
    # a request with no recorded prefix attaches to the root
    assert tree.deepest_match([b"zz", b"yy"]) is None
    d = call(tree, 0, [7], [14], b"D", role="subagent")
    assert tree.children(0) == [a.node_id, d.node_id]
    assert tree.children(a.node_id) == [b.node_id, c.node_id]
    assert tree.leaves() == [b.node_id, c.node_id, d.node_id]
    assert tree.context_ids(b.node_id).tolist() == [1, 2, 3, 10, 11, 4]
    assert tree.full_ids(c.node_id).tolist() == [1, 2, 3, 10, 11, 5, 6, 13]
    s = tree.stats()
    assert (s.unique_tokens, s.flat_tokens) == (5 + 2 + 3 + 2, 7 + 8 + 2)


def test_equal_outputs_stay_separate_nodes_and_lookup_returns_latest() -> None:
    tree = TrajectoryTree("x")
    first = call(tree, 0, [1, 2], [9, 9], b"same")
    second = call(tree, 0, [1, 2], [9, 9], b"same")
    assert first.node_id != second.node_id and len(tree) == 2
    assert tree.find_by_output_key(b"same") is second
    assert tree.find_by_output_key(b"missing") is None
    assert tree.stats().flat_tokens == 8


def test_recorded_arrays_are_copied_and_frozen() -> None:
    tree = TrajectoryTree("x")
    src = np.array([1, 2, 3], np.int32)
    n = call(tree, 0, src, [4], b"k")
    src[0] = 99
    assert n.input_ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        n.input_ids[0] = 5
    assert n.input_ids.dtype == np.int32 and n.input_provenance.dtype == np.uint8
    assert n.output_ids.dtype == np.int32 and n.output_logprobs.dtype == np.float32


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"parent_id": 5}, "parent_id"),
        ({"parent_id": -1}, "parent_id"),
        ({"input_ids": [1.5, 2.0]}, "input_ids: must hold integers"),
        ({"input_ids": [[1, 2]]}, "input_ids: must be 1-D"),
        ({"input_ids": [2**31]}, "int32"),
        ({"input_provenance": [2]}, "input_provenance: length"),
        ({"input_provenance": [2, 9]}, "Provenance codes"),
        ({"input_provenance": [0, 2]}, "POLICY"),
        ({"output_logprobs": [-1.0]}, "output_logprobs: length"),
        ({"output_logprobs": ["a", "b"]}, "output_logprobs"),
        ({"output_logprobs": [float("nan"), -1.0]}, "finite"),
        ({"output_key": b"x" * 33}, "at most 32"),
        ({"input_key": "text"}, "input_key: must be bytes"),
        ({"role": ""}, "role"),
        ({"role": 3}, "role"),
        ({"t_end": 0.5}, "t_end"),
        ({"policy_version": 1.5}, "policy_version"),
        ({"attempts": 0}, "attempts"),
    ],
)
def test_bad_node_is_rejected_clearly_and_tree_is_unchanged(kw: dict, needle: str) -> None:
    tree = TrajectoryTree("x")
    call(tree, 0, [1, 2], [3], b"a")
    before = TrajectoryTree.from_dict(tree.to_dict())
    args = {"input_ids": [1, 2], "input_provenance": [2, 2], "output_logprobs": [-1.0, -2.0]}
    args.update(kw)
    parent = args.pop("parent_id", 1)
    with pytest.raises(TreeError, match=needle) as err:
        call(tree, parent, args.pop("input_ids"), [7, 8], args.pop("output_key", b"b"), **args)
    assert isinstance(err.value, GyreError) and isinstance(err.value, ValueError)
    assert trees_equal(tree, before) and tree.leaves() == [1]
    assert tree.find_by_output_key(b"b") is None


def test_unknown_node_lookups_raise() -> None:
    tree = make_tree(1, "x", 3)
    for bad in (0, 4, -1):
        with pytest.raises(TreeError, match="node_id"):
            tree.node(bad)
    with pytest.raises(TreeError):
        tree.context_ids(9)
    with pytest.raises(TreeError, match="node_id"):
        TrajectoryTree.from_dict({"execution_id": "x", "nodes": [{"node_id": 2}]})


def test_diff_names_the_differing_field() -> None:
    a, b = make_tree(5, "x", 4), make_tree(5, "x", 4)
    assert a == b
    c = make_tree(6, "x", 4)
    assert a != c and any(d.startswith("node 1:") for d in tree_diff(a, c))


def test_long_execution_costs_stay_proportional_to_new_tokens() -> None:
    """500 calls / ~1M tokens in one main path: recording must not re-walk the path."""
    tree = TrajectoryTree("long")
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50_000, 1_900).astype(np.int32)
    prov = np.full(1_900, Provenance.TOOL, np.uint8)
    out, lps = block[:100], np.full(100, -0.1, np.float32)
    t = time.perf_counter()
    parent = 0
    for i in range(500):
        key = i.to_bytes(4, "little")
        if i:
            assert tree.find_by_output_key((i - 1).to_bytes(4, "little")).node_id == parent
        parent = call(
            tree, parent, block, out, key, input_provenance=prov, output_logprobs=lps
        ).node_id
    build = time.perf_counter() - t
    t = time.perf_counter()
    s = tree.stats()
    stats_time = time.perf_counter() - t
    assert s.unique_tokens == 1_000_000 and s.flat_tokens == 1_000_000
    assert s.num_leaves == 1
    assert build < 3.0, build  # O(new tokens): ~10 ms on one core; a path re-walk is O(n^2)
    assert stats_time < 0.1, stats_time
    assert len(tree.context_ids(parent)) == 1_000_000 - 100


@settings(max_examples=60, deadline=None)
@given(trees(), st.lists(st.binary(max_size=3), max_size=6))
def test_deepest_match_is_the_last_recorded_key(tree: TrajectoryTree, extra: list[bytes]) -> None:
    keys = [n.output_key for n in tree.nodes[::2]] + extra
    latest = {n.output_key: n for n in tree.nodes}  # later nodes overwrite earlier ones
    hits = [(i, latest[k]) for i, k in enumerate(keys) if k in latest]
    assert tree.deepest_match(keys) == (hits[-1] if hits else None)
