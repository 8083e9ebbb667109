"""Prefix cache: KV caches of finished calls, reused when a new call extends their tokens.

An agent's next model call usually starts with the whole previous context (system prompt,
tools, history, the previous output). Re-prefilling it every turn dominates CPU time, so
the engine keeps the KV cache of each finished call (an LRU bounded in bytes) and, when a
new call arrives, prefills only the tokens after the longest cached common prefix. KV
entries are exact copies of what a fresh prefill computes, so log-probs do not change
(tests check them against a plain forward pass). Any change of weights clears the cache.

Each entry carries a *tag*, the rid of the call that produced it (or that it was migrated
for), so KV-cache migration can find an execution's cached prefixes by rid
(`gyre.rollout.kvstore`); entries migrated from another engine are inserted here too.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, n, D]


@dataclass(slots=True)
class _Entry:
    tokens: np.ndarray
    layers: LayerKV
    nbytes: int
    tag: str
    routing: np.ndarray | None = None  # int32 [tokens, layers, top_k] of a MoE model


class PrefixCache:
    """LRU of (tokens, KV) pairs bounded by `capacity_bytes` (0 disables it)."""

    def __init__(self, capacity_bytes: int, *, min_tokens: int = 4) -> None:
        self.capacity_bytes = capacity_bytes
        self.min_tokens = min_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.hits = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(
        self, tokens: list[int] | np.ndarray, layers: LayerKV, tag: str = "",
        routing: np.ndarray | None = None,
    ) -> bool:  # fmt: skip
        """Keep `layers` (the KV of exactly `tokens`, and where the model routes experts the
        routing of those positions) tagged with a rid; drops entries it extends. False if it
        is too short or larger than the whole cache (not kept)."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if len(tokens) < self.min_tokens or nbytes > self.capacity_bytes:
            return False
        arr = np.asarray(tokens, dtype=np.int64)
        for key, entry in list(self._entries.items()):
            n = len(entry.tokens)
            if n <= len(arr) and np.array_equal(entry.tokens, arr[:n]):
                self._drop(key)
        self._entries[self._next_key] = _Entry(arr, layers, nbytes, tag, routing)
        self._next_key += 1
        self.nbytes += nbytes
        while self.nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def entries(self) -> list[tuple[str, np.ndarray, LayerKV]]:
        """(tag, tokens, per-layer KV) of every entry, oldest first (nothing is copied)."""
        return [(e.tag, e.tokens, e.layers) for e in self._entries.values()]

    def lookup(self, tokens: list[int]) -> tuple[int, LayerKV | None, np.ndarray | None]:
        """Longest cached prefix of `tokens` leaving at least one token to prefill:
        (its length, per-layer KV and routing sliced to it) or (0, None, None)."""
        if not self._entries or len(tokens) <= self.min_tokens:
            return 0, None, None
        arr = np.asarray(tokens, dtype=np.int64)
        best, best_key = 0, None
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(arr) - 1)
            diff = np.nonzero(entry.tokens[:n] != arr[:n])[0]
            common = int(diff[0]) if diff.size else n
            if common > best:
                best, best_key = common, key
        if best_key is None or best < self.min_tokens:
            return 0, None, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best
        entry = self._entries[best_key]
        routing = None if entry.routing is None else entry.routing[:best]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in entry.layers], routing

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
