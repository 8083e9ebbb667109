from collections import defaultdict


class Stock:
    """Quantities per (warehouse, item)."""

    def __init__(self):
        self._q = defaultdict(int)

    def add(self, warehouse, item, n):
        if n < 0:
            raise ValueError("n must be >= 0")
        self._q[(warehouse, item)] += n

    def remove(self, warehouse, item, n):
        self._q[(warehouse, item)] -= n

    def quantity(self, item):
        return sum(q for (w, i), q in self._q.items() if i == item)

    def items(self):
        return sorted({i for (_, i) in self._q})

    def total(self):
        return max(self._q.values(), default=0)
