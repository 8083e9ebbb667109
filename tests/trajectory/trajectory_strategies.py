"""Hypothesis strategies and builders for random trajectory trees (shared by the trajectory tests)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gyre.trajectory.tree import Provenance, TrajectoryTree

# unicode text including NUL, surrogate-free (UTF-8 encodable), possibly empty
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
ROLE = st.one_of(
    st.sampled_from(["main", "subagent", "compaction", "ṛôlé-∑", "角色"]), TEXT.filter(bool)
)
KEY = st.binary(min_size=0, max_size=32)
NON_POLICY = [int(p) for p in Provenance if p != Provenance.POLICY]


@st.composite
def node_kwargs(draw: st.DrawFn, n_existing: int, routing: tuple[int, int] | None = None) -> dict:
    """One node's `add_node` arguments; with `routing` = (layers, top_k), maybe routed experts."""
    n_in = draw(st.integers(0, 40))
    n_out = draw(st.integers(0, 20))
    ids = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n_in, max_size=n_in))
    prov = draw(st.lists(st.sampled_from(NON_POLICY), min_size=n_in, max_size=n_in))
    out = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n_out, max_size=n_out))
    lps = draw(
        st.lists(
            st.floats(width=32, allow_nan=False, allow_infinity=False),
            min_size=n_out,
            max_size=n_out,
        )
    )
    t0 = draw(st.floats(0, 2e9, allow_nan=False))
    return dict(
        parent_id=draw(st.integers(0, n_existing)),
        input_ids=np.array(ids, np.int64),
        input_provenance=np.array(prov, np.uint8),
        output_ids=np.array(out, np.int32),
        output_logprobs=np.array(lps, np.float32),
        role=draw(ROLE),
        policy_version=draw(st.integers(-(2**63), 2**63 - 1)),
        engine_id=draw(TEXT),
        t_start=t0,
        t_end=t0 + draw(st.floats(0, 1e4, allow_nan=False)),
        finish_reason=draw(st.sampled_from(["stop", "length", "tool_calls", "abort", ""])),
        input_key=draw(KEY),
        output_key=draw(KEY),
        attempts=draw(st.integers(1, 2**31 - 1)),
        routed_experts=draw(st.none() | hnp.arrays(np.int16, (n_in + n_out, *routing),
                                                   elements=st.integers(-1, 2**15 - 1)))
        if routing else None,
    )  # fmt: skip


@st.composite
def trees(
    draw: st.DrawFn, max_nodes: int = 12, execution_id: str | None = None, routing: bool = False
) -> TrajectoryTree:
    """A random tree; with `routing`, of a random (layers, top_k) that its nodes may carry
    routed experts of (some do, some do not)."""
    eid = execution_id if execution_id is not None else draw(TEXT)
    shape = (draw(st.integers(0, 3)), draw(st.integers(1, 3))) if routing else None
    tree = TrajectoryTree(eid)
    for i in range(draw(st.integers(0, max_nodes))):
        tree.add_node(**draw(node_kwargs(i, shape)))
    return tree


def make_tree(
    seed: int, execution_id: str, n_nodes: int, max_in: int = 60,
    routing: tuple[int, int] | None = None,
) -> TrajectoryTree:  # fmt: skip
    """A deterministic pseudo-random tree (the same for a given seed in every process); with
    `routing` = (layers, top_k), most of its nodes carry routed experts of 64 experts."""
    rng = np.random.default_rng(seed)
    tree = TrajectoryTree(execution_id)
    for i in range(n_nodes):
        n_in, n_out = int(rng.integers(0, max_in)), int(rng.integers(0, 30))
        routed = None
        if routing is not None and rng.random() < 0.8:
            routed = rng.integers(-1, 64, (n_in + n_out, *routing))
        t0 = float(rng.uniform(1e9, 2e9))
        tree.add_node(
            parent_id=int(rng.integers(0, i + 1)) if rng.random() < 0.3 else i,
            input_ids=rng.integers(0, 50_000, n_in),
            input_provenance=rng.integers(1, 7, n_in),
            output_ids=rng.integers(0, 50_000, n_out),
            output_logprobs=-rng.exponential(1.0, n_out).astype(np.float32),
            role=["main", "subagent", "compaction"][int(rng.integers(0, 3))],
            policy_version=int(rng.integers(0, 10)),
            engine_id=f"engine-{rng.integers(0, 4)}",
            t_start=t0,
            t_end=t0 + float(rng.uniform(0, 30)),
            finish_reason="stop",
            input_key=rng.bytes(32),
            output_key=rng.bytes(32),
            attempts=1,
            routed_experts=routed,
        )
    return tree
