"""Routed experts: which experts a mixture-of-experts model sent each position to.

SGLang 0.5.21 returns them when a /generate body asks (`return_routed_experts`, the server
started with `--enable-return-routed-experts`): `meta_info.routed_experts` is the base64 of
an int32 array `[positions, layers, top_k]` in C order, covering the positions
`[routed_experts_start_len, seqlen - 1)` (every position the model ran, the last sampled
token never being one). `encode` / `decode` are that wire format, for the embedded engine
and the client alike.

`RouterTap` is how the embedded engine knows them: a forward hook on each MoE layer's router
of a transformers model (Qwen3-MoE's and Qwen2-MoE's `...TopKRouter`, which return
`(logits, top-k weights, top-k indices)`), collecting the indices of one forward pass.

    tap = RouterTap.of_model(model)        # None for a dense model
    model(input_ids=ids, ...)              # [rows, width] tokens
    tap.take(rows=1)                       # int32 [1, width, layers, top_k]
"""

from __future__ import annotations

import base64
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
        for i, router in enumerate(routers):
            router.register_forward_hook(self._hook(i))

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> RouterTap | None:
        """A tap on every router of `model`; None for a model without routed experts."""
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        return cls(routers) if routers else None

    @property
    def layers(self) -> int:
        return len(self._seen)

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._seen[layer] = output[2].detach()  # (logits, weights, indices [tokens, k])

        return hook

    def take(self, rows: int) -> np.ndarray:
        """The last forward's routing as int32 `[rows, width, layers, top_k]` (its tokens
        in the input's row-major order); forgets it."""
        seen, self._seen = self._seen, [None] * len(self._seen)
        if any(s is None for s in seen):
            raise RuntimeError("RouterTap.take: a router did not run in the last forward")
        import torch

        stacked = torch.stack([s for s in seen if s is not None], dim=1)  # [tokens, L, k]
        return stacked.to(torch.int32).numpy().reshape(rows, -1, self.layers, self.top_k)
