"""The scheduler's rollout engines: which accept executions, launch placement, reroute order.

Engines `0..K·E-1` belong to the cells, E each (cell c's are c·E .. c·E+E-1; they accept
executions only while their cell is in ROLLOUT), `K·E..K·E+S-1` are standalone and always
accept. Everything is kept incrementally, so
a launch, a termination or a role change costs O(log engines), never a scan of all of them:

* `capacity` is C_R, the concurrency of the accepting engines (Eq. 6's left side);
* launch goes to the accepting engine with the most free slots (lowest index on a tie), from
  a heap of (-free, index) entries that are checked against the engine when popped;
* a reroute (§4.3) fills standalone engines first, then rollout cells in descending order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from gyre.errors import SchedulerError


@dataclass(slots=True)
class Engine:
    """A rollout engine: a cell's (while it is in ROLLOUT) or a standalone one."""

    index: int
    cell: int | None
    capacity: int
    running: set[int] = field(default_factory=set)
    accepting: bool = True  # its cell is in ROLLOUT (always, standalone)
    up: bool = True  # its process is alive (False from EngineLost to EngineRestored)

    @property
    def free(self) -> int:
        return self.capacity - len(self.running)

    @property
    def open(self) -> bool:
        """Takes launches and reroutes now: accepting by role, and up."""
        return self.accepting and self.up


class Engines:
    """All rollout engines, their routes and the free-slot heap."""

    def __init__(
        self, cells: int, standalone: int, capacity: int, per_cell: int = 1,
        cell_capacity: int | None = None,
    ) -> None:  # fmt: skip
        """`capacity`: a standalone (cell-sized) engine's slots; `cell_capacity`: each of a
        cell's `per_cell` engines' (`Config.engine_concurrency`; default `capacity`)."""
        each = capacity if cell_capacity is None else cell_capacity
        self.per_cell = per_cell
        n = cells * per_cell
        self.engines = [Engine(i, i // per_cell, each) for i in range(n)]
        self.engines += [Engine(n + j, None, capacity) for j in range(standalone)]
        # §4.3: standalone engines first, then rollout cells in descending cell order.
        self.reroute_order = self.engines[n:] + self.engines[n - 1 :: -1]
        self.capacity = sum(e.capacity for e in self.engines)  # C_R
        self.route: dict[int, int] = {}  # running execution -> engine
        self._heap = [(-e.free, e.index) for e in self.engines]
        heapq.heapify(self._heap)  # a cell's engines may have fewer slots than a standalone

    def set_accepting(self, cell: int, accepting: bool) -> None:
        """A cell's engines start or stop accepting executions (its role changed)."""
        for e in self.of_cell(cell):
            self._change(e, accepting=accepting)

    def of_cell(self, cell: int) -> list[Engine]:
        """The engines of `cell`."""
        return self.engines[cell * self.per_cell : (cell + 1) * self.per_cell]

    def set_up(self, index: int, up: bool) -> list[tuple[int, int]]:
        """An engine's process died (up=False) or is back; a lost engine's executions move
        to open engines while there are free slots: (x, destination) per move."""
        e = self.engines[index]
        self._change(e, up=up)
        if up:
            return []
        return self._move_off(e, strict=False)

    def _change(self, e: Engine, *, accepting: bool | None = None, up: bool | None = None) -> None:
        was = e.open
        if accepting is not None:
            e.accepting = accepting
        if up is not None:
            e.up = up
        if e.open != was:
            self.capacity += e.capacity if e.open else -e.capacity
        if e.open:
            self._push(e)

    def place(self, execution: int) -> int | None:
        """Start `execution` on the accepting engine with the most free slots, if any."""
        heap = self._heap
        while heap:
            neg_free, i = heap[0]
            e = self.engines[i]
            if not e.open or e.capacity - len(e.running) != -neg_free:
                heapq.heappop(heap)  # stale entry
                continue
            if neg_free == 0:
                return None
            self._add(e, execution)
            return i
        return None

    def remove(self, execution: int) -> int | None:
        """Take a terminated execution off its engine; its engine, or None if not running."""
        i = self.route.pop(execution, None)
        if i is not None:
            e = self.engines[i]
            e.running.discard(execution)
            if e.open:
                self._push(e)
        return i

    def reroute(self, cell: int) -> list[tuple[int, int, int]]:
        """Move every execution off the cell's engines (they stopped accepting):
        (x, source engine, destination) per move."""
        return [(x, e.index, dest) for e in self.of_cell(cell)
                for x, dest in self._move_off(e, strict=True)]  # fmt: skip

    def _move_off(self, source: Engine, *, strict: bool) -> list[tuple[int, int]]:
        """Reserve destinations for the source's executions in §4.3 order. Strict (a role
        change, which Eq. 6 made room for): every one must move. Otherwise (a lost engine)
        those that find no free slot stay where they are, nominally."""
        moves: list[tuple[int, int]] = []
        order = iter(self.reroute_order)
        dest = next(order, None)
        for x in sorted(source.running):
            while dest is not None and (dest is source or not dest.open or dest.free <= 0):
                dest = next(order, None)
            if dest is None:
                if strict:
                    raise SchedulerError(f"no rollout capacity left to reroute execution {x}")
                break
            source.running.discard(x)
            self._add(dest, x)
            moves.append((x, dest.index))
        if strict:
            source.running.clear()
        return moves

    def _add(self, e: Engine, x: int) -> None:
        e.running.add(x)
        self.route[x] = e.index
        self._push(e)

    def _push(self, e: Engine) -> None:
        heapq.heappush(self._heap, (len(e.running) - e.capacity, e.index))
        if len(self._heap) > 4 * len(self.engines) + 64:  # drop the stale entries
            self._heap = [(-g.free, g.index) for g in self.engines if g.open]
            heapq.heapify(self._heap)
