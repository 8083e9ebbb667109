"""Admission sampling (§5.3) against exact enumeration of the procedure, plus properties."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError, TrainingError
from gyre.train.admission import AdmissionConfig, AdmissionTree, admit

ROLES = ["main", "compaction", "subagent", "tool-helper"]  # the last is not in the priority list


@st.composite
def trees(draw, max_nodes: int = 9) -> AdmissionTree:
    n = draw(st.integers(1, max_nodes))
    parent = tuple(draw(st.integers(0, i - 1)) for i in range(1, n + 1))
    role = tuple(draw(st.sampled_from(ROLES)) for _ in range(n))
    trainable = tuple(draw(st.integers(0, 4)) for _ in range(n))
    return AdmissionTree(parent=parent, role=role, trainable=trainable)


def _rank(role: str, priority: list[str]) -> int:
    return priority.index(role) if role in priority else len(priority)


def exact(tree: AdmissionTree, j_max: int | None, priority: list[str]) -> dict:
    """Probability of every admitted sequence, by enumerating all draws (slow reference)."""
    leaves = [i for i in range(1, len(tree.parent) + 1) if i not in tree.parent]

    def path(leaf: int) -> list[int]:
        out = []
        while leaf:
            out.append(leaf)
            leaf = tree.parent[leaf - 1]
        return out

    out: dict = {}

    def rec(masked: frozenset, seq: tuple, p: Fraction) -> None:
        counts = {
            lf: sum(tree.trainable[n - 1] for n in path(lf) if n not in masked) for lf in leaves
        }
        live = [lf for lf in leaves if counts[lf] > 0]
        if not live or (j_max is not None and len(seq) == j_max):
            out[seq] = out.get(seq, 0) + p
            return
        best = min(_rank(tree.role[lf - 1], priority) for lf in live)
        cls = [lf for lf in live if _rank(tree.role[lf - 1], priority) == best]
        total = sum(counts[lf] for lf in cls)
        for lf in cls:
            tg = frozenset(n for n in path(lf) if n not in masked and tree.trainable[n - 1])
            rec(masked | set(path(lf)), (*seq, (lf, tg)), p * Fraction(counts[lf], total))

    rec(frozenset(), (), Fraction(1))
    return out


def _key(picked) -> tuple:
    return tuple((a.leaf, frozenset(a.target_nodes)) for a in picked)


@pytest.mark.parametrize("case", range(6))
def test_empirical_distribution_matches_exact_enumeration(case: int) -> None:
    import random

    rng = random.Random(case)
    n = rng.randint(5, 9)
    tree = AdmissionTree(
        parent=tuple(rng.randint(0, i - 1) for i in range(1, n + 1)),
        role=tuple(rng.choice(ROLES) for _ in range(n)),
        trainable=tuple(rng.randint(0, 4) for _ in range(n)),
    )
    j_max = [1, 2, 3, None][case % 4]
    priority = ["main", "compaction", "subagent"] if case % 2 else ["subagent", "main"]
    want = exact(tree, j_max, priority)
    cfg = AdmissionConfig(j_max=j_max, role_priority=priority)
    draws = 4000
    got = Counter(_key(admit(tree, config=cfg, seed=case * 100_000 + s)) for s in range(draws))
    assert set(got) <= set(want), "admitted a sequence the procedure cannot produce"
    for seq, p in want.items():
        p = float(p)
        tol = 4.5 * math.sqrt(p * (1 - p) / draws) + 1.5 / draws
        assert abs(got[seq] / draws - p) <= tol, (seq, got[seq] / draws, p)


@settings(max_examples=200, deadline=None)
@given(trees(), st.sampled_from([1, 2, 5, None]), st.integers(0, 2**32))
def test_properties(tree: AdmissionTree, j_max: int | None, seed: int) -> None:
    cfg = AdmissionConfig(j_max=j_max)
    picked = admit(tree, config=cfg, seed=seed)
    assert j_max is None or len(picked) <= j_max
    seen: set[int] = set()
    for a in picked:
        assert a.num_targets == sum(tree.trainable[n - 1] for n in a.target_nodes) > 0
        assert all(tree.trainable[n - 1] > 0 for n in a.target_nodes)  # provenance mask
        assert set(a.target_nodes) <= set(tree.path(a.leaf))
        assert not seen & set(a.target_nodes), "target sets must be disjoint"
        seen |= set(a.target_nodes)
    if j_max is None or len(picked) < j_max:  # stopped because nothing trainable remains
        assert seen == {i for i, c in enumerate(tree.trainable, start=1) if c > 0}
    assert admit(tree, config=cfg, seed=seed) == picked  # seeded


def test_priority_classes_are_exhausted_in_order() -> None:
    # two roots: a main path and a subagent path, plus a compaction leaf under main
    tree = AdmissionTree(parent=(0, 1, 1, 0), role=("main", "main", "compaction", "subagent"),
                         trainable=(3, 2, 5, 9))  # fmt: skip
    picked = admit(tree, config=AdmissionConfig(j_max=None), seed=0)
    assert [a.leaf for a in picked] == [2, 3, 4]
    assert [a.num_targets for a in picked] == [5, 5, 9]  # node 1 counted once
    only = admit(tree, config=AdmissionConfig(j_max=1, role_priority=["subagent"]), seed=0)
    assert [a.leaf for a in only] == [4]


def test_bad_config_and_tree() -> None:
    with pytest.raises(ConfigError, match="j_max"):
        AdmissionConfig(j_max=0)
    with pytest.raises(ConfigError, match="role_priority"):
        AdmissionConfig(role_priority=["main", "main"])
    with pytest.raises(TrainingError, match="parent"):
        AdmissionTree(parent=(1,), role=("main",), trainable=(1,))
