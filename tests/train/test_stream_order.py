"""The stream packing buffer hands out ready groups oldest first, against a slow reference.

`StreamPackingBuffer.pull()` takes "the ready group with the oldest policy version" from a
heap. The reference keeps every ready group in a plain list as (policy version, arrival) and
takes the minimum by a full scan: the lowest version, and among equal versions the one that
arrived first. Random interleavings of `add_ready`, `pull` and new batches must agree with it
on every group taken, and on when a batch closes.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.train.rewards import ExecutionOutcome, Status
from gyre.train.stream import ReadyGroup, StreamConfig, StreamPackingBuffer
from gyre.train.synthetic import branching_tree
from gyre.trajectory.tree import TrajectoryTree


@functools.cache
def tiny_tree(execution_id: str) -> TrajectoryTree:
    """One main-agent call: a few tokens, so packing costs nothing."""
    rng = np.random.default_rng(len(execution_id))
    return branching_tree(rng, execution_id, vocab=64, subagents=0, turns=1, compactions=0, scale=1)


def ready_group(group_id: str, version: int) -> ReadyGroup:
    eid = f"{group_id}-e0"
    outcome = ExecutionOutcome(execution_id=eid, status=Status.VALID, reward=1.0)
    return ReadyGroup(
        group_id=group_id, policy_version=version, outcomes=[outcome], trees={eid: tiny_tree(eid)}
    )


# ("push", v): a ready group of policy version v arrives; ("pull", _): the trainer pulls
PLAN = st.lists(
    st.tuples(st.sampled_from(["push", "pull"]), st.integers(0, 3)), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(batch_groups=st.integers(1, 3), plan=PLAN)
def test_pull_takes_the_oldest_ready_group_first(
    batch_groups: int, plan: list[tuple[str, int]]
) -> None:
    """Each pull takes the lowest policy version (earliest arrival on a tie) while the batch
    needs groups; the batch closes at its B-th group and the next one starts afresh."""
    buf = StreamPackingBuffer(StreamConfig(groups_per_batch=batch_groups, group_size=1))
    waiting: list[tuple[int, int, str]] = []  # the reference: (version, arrival, group id)
    taken: list[tuple[int, int, str]] = []  # the current batch's groups, reference order
    for arrival, (op, version) in enumerate(plan):
        if op == "push":
            gid = f"g{arrival}"
            buf.add_ready(ready_group(gid, version))
            waiting.append((version, arrival, gid))
        else:
            if buf.closed:  # the closed batch was consumed: start the next one
                buf.begin_batch()
                taken = []
            if waiting and len(taken) < batch_groups:
                oldest = min(waiting)
                waiting.remove(oldest)
                taken.append(oldest)
            buf.pull()
            info = buf.batch_info()
            assert info.group_ids == [gid for _, _, gid in taken], f"after {plan[: arrival + 1]}"
            assert info.policy_versions == [v for v, _, _ in taken]
            assert buf.closed == (len(taken) == batch_groups)
        assert buf.ready_groups == len(waiting)
