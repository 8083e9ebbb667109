"""The running batch's KV cache: per-sequence caches merged into one left-padded batch.

Continuous batching at decode-step granularity needs one cache holding every running
sequence. Each new sequence is prefilled alone (its own `DynamicCache`), then merged:
both caches are left-padded with zeros to the longer length and concatenated along the
batch axis; a 0/1 attention mask marks the padding. Finished sequences are dropped with an
index-select, and leading columns that are padding in every remaining row are trimmed.
Position ids are each row's count of real tokens, so a padded row computes exactly what
it would alone (up to float rounding). Works for caches whose layers are plain full-length
`DynamicLayer`s (Qwen2, Llama); sliding-window layers are rejected.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from gyre.models import check_cache_layers


class KVBatch:
    """Left-padded KV cache and attention mask of the running sequences, in row order."""

    def __init__(self, cache_kwarg: str = "past_key_values") -> None:
        self.cache_kwarg = cache_kwarg
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def add(self, cache: Any, length: int) -> None:
        """Append one prefilled sequence (`cache` holds `length` real positions) as a new row."""
        check_cache_layers(cache)
        row = torch.ones(1, length, dtype=torch.long)
        if self.cache is None or self.size == 0:
            self.cache, self.mask = cache, row
            return
        total = max(self.mask.shape[1], length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad(mine.keys, total), _pad(theirs.keys, total)], dim=0)
            mine.values = torch.cat([_pad(mine.values, total), _pad(theirs.values, total)], dim=0)
        self.mask = torch.cat([_pad_mask(self.mask, total), _pad_mask(row, total)], dim=0)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order); trim columns that became all padding."""
        if not rows:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.mask[index]
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        self.mask = mask[:, start:]

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of one row's real (unpadded) keys and values, per layer: [1, H, n, D]."""
        return [(k.clone(), v.clone()) for k, v in self.row_views(row, self.row_length(row))]

    def row_length(self, row: int) -> int:
        """How many real (fed) positions `row` holds."""
        return int(self.mask[row].sum())

    def row_views(self, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views (no copy) of the first `n` real positions of `row`, per layer: [1, H, n, D]."""
        start = self.mask.shape[1] - self.row_length(row)  # left padding: real ones are last
        return [
            (
                layer.keys[row : row + 1, :, start : start + n],
                layer.values[row : row + 1, :, start : start + n],
            )
            for layer in self.cache.layers
        ]

    def step_inputs(self, tokens: list[int]) -> dict[str, Any]:
        """Model kwargs for one decode step feeding `tokens` (one per row); extends the mask."""
        positions = self.mask.sum(dim=1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(self.size, 1, dtype=torch.long)], dim=1)
        return {
            "input_ids": torch.tensor(tokens, dtype=torch.long).unsqueeze(1),
            "attention_mask": self.mask,
            "position_ids": positions,
            self.cache_kwarg: self.cache,
            "use_cache": True,
        }


def cache_kwarg(model: Any) -> str:
    """The forward() argument that takes a KV cache: `cache` (transformers >= 5.2x) or
    `past_key_values` (older)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache a forward() returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A DynamicCache holding copies of per-layer (keys, values)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _pad(t: torch.Tensor, total: int) -> torch.Tensor:
    return F.pad(t, (0, 0, total - t.shape[2], 0))


def _pad_mask(m: torch.Tensor, total: int) -> torch.Tensor:
    return F.pad(m, (total - m.shape[1], 0))
