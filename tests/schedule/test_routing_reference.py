"""Every routing decision against a slow, obvious reference under random operation sequences.

`gyre.schedule.routing.Engines` keeps a heap of free slots so that a launch costs O(log
engines). The reference below keeps only each engine's set of running executions and its
flags, and decides every launch and every reroute by a scan of all engines, straight from the
module's rule:

* a launch goes to the open (accepting and up) engine with the most free slots, the lowest
  index on a tie, and to none when no open engine has a free slot;
* a reroute (a cell stops accepting, or an engine is lost) moves the source's executions in
  ascending id order, each to the first open engine with a free slot in §4.3 order:
  standalone engines first, then cells in descending order. A role change must move every
  one (else `SchedulerError`); a lost engine keeps, nominally, those that find no slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import SchedulerError
from gyre.schedule.routing import Engines


@dataclass
class ReferenceRouting:
    """All engines as plain sets and flags; every decision is a full scan."""

    cells: int
    standalone: int
    slots: int
    running: list[set[int]] = field(init=False)
    accepting: list[bool] = field(init=False)
    up: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        n = self.cells + self.standalone
        self.running = [set() for _ in range(n)]
        self.accepting = [True] * n
        self.up = [True] * n

    def is_open(self, e: int) -> bool:
        return self.accepting[e] and self.up[e]

    def free(self, e: int) -> int:
        return self.slots - len(self.running[e])

    def capacity(self) -> int:
        return sum(self.slots for e in range(len(self.running)) if self.is_open(e))

    def route(self) -> dict[int, int]:
        return {x: e for e, xs in enumerate(self.running) for x in xs}

    def place(self, x: int) -> int | None:
        candidates = [e for e in range(len(self.running)) if self.is_open(e) and self.free(e) > 0]
        if not candidates:
            return None
        best = max(self.free(e) for e in candidates)
        e = min(e for e in candidates if self.free(e) == best)
        self.running[e].add(x)
        return e

    def reroute_order(self) -> list[int]:
        k = self.cells
        return list(range(k, k + self.standalone)) + list(range(k - 1, -1, -1))

    def room_elsewhere(self, source: int) -> int:
        return sum(self.free(e) for e in self.reroute_order() if e != source and self.is_open(e))

    def move_off(self, source: int) -> list[tuple[int, int]]:
        """Each of the source's executions, in id order, to the first open engine with room."""
        moves = []
        for x in sorted(self.running[source]):
            dest = next(
                (
                    e
                    for e in self.reroute_order()
                    if e != source and self.is_open(e) and self.free(e) > 0
                ),
                None,
            )
            if dest is None:
                break
            self.running[source].discard(x)
            self.running[dest].add(x)
            moves.append((x, dest))
        return moves


OPS = ["place", "place", "place", "remove", "remove", "leave", "join", "lose", "restore"]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[str, int]]]:
    cells = draw(st.integers(1, 4))
    standalone = draw(st.integers(0, 2))
    slots = draw(st.integers(1, 4))
    ops = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 15)), max_size=80))
    return cells, standalone, slots, ops


def assert_same_state(router: Engines, ref: ReferenceRouting) -> None:
    assert [e.running for e in router.engines] == ref.running
    assert router.route == ref.route()
    assert router.capacity == ref.capacity()


@settings(max_examples=300, deadline=None)
@given(world=worlds())
def test_every_launch_and_reroute_matches_the_reference(
    world: tuple[int, int, int, list[tuple[str, int]]],
) -> None:
    """Launch on the most-free open engine (lowest index on a tie); reroutes in §4.3 order;
    capacity, routes and per-engine executions equal the reference after every operation."""
    cells, standalone, slots, ops = world
    router, ref = Engines(cells, standalone, slots), ReferenceRouting(cells, standalone, slots)
    engines = cells + standalone
    next_id = 0
    for op, n in ops:
        if op == "place":
            assert router.place(next_id) == ref.place(next_id), f"launch of execution {next_id}"
            next_id += 1
        elif op == "remove":
            running = sorted(ref.route())
            x = running[n % len(running)] if running and n < 12 else next_id + n  # or a stranger
            expected = ref.route().get(x)
            if expected is not None:
                ref.running[expected].discard(x)
            assert router.remove(x) == expected
        elif op == "leave":  # a rollout cell switches to training: stop accepting, reroute all
            c = n % cells
            if not ref.accepting[c]:
                continue
            fits = len(ref.running[c]) <= ref.room_elsewhere(c)
            router.set_accepting(c, False)
            ref.accepting[c] = False
            if not fits:
                with pytest.raises(SchedulerError, match="no rollout capacity left"):
                    router.reroute(c)
                return  # Eq. 6 forbids this switch; the router's state is no longer used
            moves = router.reroute(c)
            assert all(source == c for _, source, _ in moves)  # one engine per cell here
            assert [(x, dest) for x, _, dest in moves] == ref.move_off(c)
        elif op == "join":  # the cell is back in rollout
            c = n % cells
            router.set_accepting(c, True)
            ref.accepting[c] = True
        elif op == "lose":
            e = n % engines
            ref.up[e] = False
            assert router.set_up(e, False) == ref.move_off(e)
        else:  # restore
            e = n % engines
            ref.up[e] = True
            assert router.set_up(e, True) == []
        assert_same_state(router, ref)


def test_a_cell_of_several_engines_counts_each_engines_slots_once() -> None:
    """Cells serving from two engines each (`engine.per_cell` 2: the cell's concurrency split
    over them) beside a standalone engine: C_R is the sum of every engine's slots, a role
    switch closes both of a cell's engines, and its executions leave both."""
    router = Engines(2, 1, 8, per_cell=2, cell_capacity=4)
    assert [e.cell for e in router.engines] == [0, 0, 1, 1, None]
    assert router.capacity == 2 * 2 * 4 + 8
    placed = [router.place(x) for x in range(4)]  # most free first: the standalone's 8 slots
    assert placed == [4, 4, 4, 4]
    for x in range(4, 12):
        router.place(x)
    on_cell0 = sorted(x for x, e in router.route.items() if e in (0, 1))
    router.set_accepting(0, False)
    assert router.capacity == 2 * 4 + 8
    moves = router.reroute(0)
    assert sorted(x for x, _, _ in moves) == on_cell0
    assert {source for _, source, _ in moves} <= {0, 1}
    assert all(dest not in (0, 1) for _, _, dest in moves)
