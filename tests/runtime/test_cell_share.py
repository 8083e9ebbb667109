"""How a cell of R ranks splits a micro-step: every row to exactly one rank, loads balanced."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gyre.runtime.cell.trainer import share
from gyre.train.packing import MicroStep, TokenRow


def _row(i: int, length: int) -> TokenRow:
    targets = np.arange(length) > 0
    return TokenRow(
        execution_id=f"e{i}", group_id="g", policy_version=0, ids=np.arange(length),
        targets=targets, behaviour_logprobs=np.where(targets, -1.0, 0.0), advantage=1.0,
        execution_targets=length - 1, weights=targets / (length - 1),
    )  # fmt: skip


@given(lengths=st.lists(st.integers(2, 40), max_size=12), ranks=st.integers(1, 5))
def test_every_row_goes_to_exactly_one_rank(lengths: list[int], ranks: int) -> None:
    rows = tuple(_row(i, n) for i, n in enumerate(sorted(lengths, reverse=True)))
    step = MicroStep(index=7, rows=rows)
    parts = [share(step, s, ranks) for s in range(ranks)]
    assert all(p.index == 7 for p in parts)
    # the obvious reference: row i belongs to rank i mod R
    assert [list(p.rows) for p in parts] == [
        [r for i, r in enumerate(rows) if i % ranks == s] for s in range(ranks)
    ]
    sizes = [len(p.rows) for p in parts]
    assert sum(sizes) == len(rows) and max(sizes) - min(sizes) <= 1
    # rows come longest first: rank s's k-th row is never shorter than rank s+1's k-th
    for a, b in itertools.pairwise(parts):
        assert all(x.length >= y.length for x, y in zip(a.rows, b.rows))
