"""Routed experts: which experts a mixture-of-experts model sent each position to.

SGLang 0.5.21 returns them when a /generate body asks (`return_routed_experts`, the server
started with `--enable-return-routed-experts`): `meta_info.routed_experts` is the base64 of
an int32 array `[positions, layers, top_k]` in C order, covering the positions
`[routed_experts_start_len, seqlen - 1)` (every position the model ran, the last sampled
token never being one). `encode` / `decode` are that wire format, for the embedded engine
and the client alike.

`RouterTap` is how the embedded engine knows them: a forward hook on each MoE layer's router
of a transformers model (Qwen3-MoE's and Qwen2-MoE's `...TopKRouter`, which return
`(logits, top-k weights, top-k indices)`), collecting the indices of one forward pass. The
torch training backend replays recorded routing through the same hooks (`replaying`): a
router's top-k indices become the recorded ones where a position has them, its weights
those experts' softmax probabilities (renormalized where the model's `norm_topk_prob` says),
computed from its logits as its own forward computes them, so its gradient still flows.

    tap = RouterTap.of_model(model)        # None for a dense model
    model(input_ids=ids, ...)              # [rows, width] tokens
    tap.take(rows=1)                       # int32 [1, width, layers, top_k]
    with tap.replaying(routing):           # [rows, width, layers, top_k], -1 unknown
        model(input_ids=ids, ...)
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from gyre.errors import ProtocolError

if TYPE_CHECKING:  # the proxy decodes without torch
    import torch


def encode(routed: np.ndarray) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of the int32 array's C-order bytes."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype=np.int32).tobytes()).decode()


def decode(text: Any, positions: int) -> np.ndarray:
    """`meta_info.routed_experts` covering `positions` positions, as int32
    `[positions, layers * top_k]`; ProtocolError when it is not that."""
    if not isinstance(text, str):
        raise ProtocolError(f"routed_experts: expected a base64 string, got {type(text).__name__}")
    try:
        flat = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.int32)
    except ValueError as e:  # binascii.Error, or a length not a multiple of 4
        raise ProtocolError(f"routed_experts: not base64 of int32 values ({e})") from None
    if positions < 0 or (positions == 0 and flat.size) or (positions and flat.size % positions):
        raise ProtocolError(f"routed_experts: {flat.size} values do not split into "
                            f"{positions} positions")  # fmt: skip
    return flat.reshape(positions, -1) if positions else flat.reshape(0, 0)


def node_rows(routed: np.ndarray, top_k: int, *, at_root: bool) -> np.ndarray:
    """A trajectory node's routed experts (`gyre.trajectory.tree.Node.routed_experts`, int16
    `[tokens, layers, top_k]`) from an engine's rows `[positions, layers * top_k]` asked
    from the position before the node's first token: under the root there is none, so a
    first row of -1 (unknown) is added. ProtocolError for rows that are not whole top-k."""
    if routed.ndim != 2 or routed.shape[1] % top_k:
        raise ProtocolError(f"routed_experts: rows of {list(routed.shape[1:])} values are not "
                            f"whole top-{top_k} choices")  # fmt: skip
    rows = routed.reshape(len(routed), -1, top_k).astype(np.int16)
    if at_root:
        rows = np.concatenate([np.full((1, *rows.shape[1:]), -1, np.int16), rows])
    return rows


class RouterTap:
    """Forward hooks on a transformers MoE model's routers, in layer order."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.top_k: int = routers[0].top_k  # type: ignore[assignment]
        self._seen: list[torch.Tensor | None] = [None] * len(routers)
        self._targets: list[torch.Tensor] | None = None  # per layer [tokens, top_k] replayed
        for i, router in enumerate(routers):
            router.register_forward_hook(self._hook(i))

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> RouterTap | None:
        """A tap on every router of a transformers `model`; None for a model without routed
        experts."""
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")
                   and type(m).__module__.startswith("transformers.")]  # fmt: skip
        return cls(routers) if routers else None

    @property
    def layers(self) -> int:
        return len(self._seen)

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._targets is not None:  # (logits, weights, indices [tokens, k])
                output = _replayed(module, output, self._targets[layer])
            self._seen[layer] = output[2].detach()
            return output

        return hook

    @contextlib.contextmanager
    def replaying(self, routing: np.ndarray | None) -> Iterator[None]:
        """The routers take `routing` ([rows, width, layers, top_k] of the forward's rows,
        -1 where unknown) as their top-k during the block; nothing replayed for None."""
        if routing is None:
            yield
            return
        import torch

        if routing.shape[2:] != (self.layers, self.top_k):
            raise ValueError(f"routing replay: rows of {list(routing.shape[2:])} for a model of "
                             f"{self.layers} MoE layers, top {self.top_k}")  # fmt: skip
        flat = torch.from_numpy(np.ascontiguousarray(routing, dtype=np.int64))
        self._targets = [flat[:, :, i].reshape(-1, self.top_k) for i in range(self.layers)]
        try:
            yield
        finally:
            self._targets = None
            self._seen = [None] * len(self._seen)

    def take(self, rows: int) -> np.ndarray:
        """The last forward's routing as int32 `[rows, width, layers, top_k]` (its tokens
        in the input's row-major order); forgets it."""
        seen, self._seen = self._seen, [None] * len(self._seen)
        if any(s is None for s in seen):
            raise RuntimeError("RouterTap.take: a router did not run in the last forward")
        import torch

        stacked = torch.stack([s for s in seen if s is not None], dim=1)  # [tokens, L, k]
        return stacked.to(torch.int32).numpy().reshape(rows, -1, self.layers, self.top_k)


def merged(target: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Top-k indices `[tokens, top_k]`: the recorded `target`'s rows where known (no -1),
    the router's `own` elsewhere. Both trainers' replay (this module's hooks, and
    gyre.train.megatron.replay in megatron-core's router) take their experts from here."""
    import torch

    target = target.to(own.device)
    return torch.where((target >= 0).all(dim=1, keepdim=True), target, own)


def _replayed(router: Any, output: Any, target: torch.Tensor) -> tuple[Any, Any, Any]:
    """A transformers router's output with `target`'s experts where known (their softmax
    probabilities, renormalized where the router renormalizes)."""
    import torch

    logits, _, own = output
    indices = merged(target, own)
    if router.norm_topk_prob:  # the chosen experts' softmax renormalized: a softmax over
        # their logits, which stays finite where the others' scores dwarf theirs
        weights = torch.softmax(logits.gather(1, indices), dim=-1, dtype=torch.float)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
    return logits, weights.to(logits.dtype), indices
