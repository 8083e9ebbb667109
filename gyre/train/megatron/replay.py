"""Routing replay: a mixture-of-experts trainer routes each position as the rollout engine did.

An MoE policy's log-probs depend on which experts each position goes to, a discrete choice a
tiny numeric difference (another kernel, batch, dtype — or an update since the call) can
flip. Trained on its own routing, the trainer computes the probabilities of a policy that
never acted. With routing replay (`train.routing_replay`) the proxy records the experts the
engine routed each position to (`Node.routed_experts`, SGLang's `return_routed_experts`), a
row carries them (`TokenRow.routing`), and each router of this rank's layers takes them as
its top-k, its weights then computed by the router from the recorded experts' scores (so
its gradient still flows). Positions without a record (-1: a node the engine reported none
for, padding, a row's last position) keep the router's own choice.

megatron-core 0.16.1 lets a router's top-k be replaced: `topk_routing_with_score_function`
asks `router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)` when the router has one (megatron/core/transformer/moe/moe_utils.py).
Megatron's own `RouterReplay` replays every position or none, and keeps every instance in a
process-wide list; `Replay` is Gyre's object in that slot, per router, merging recorded
positions into the router's own choice.

    replays = attach(model)                   # once, after the model is built
    with replayed(replays, step_routing(step, width)):   # gyre.train.packing
        model(ids, positions, mask)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from gyre.rollout.routed import merged


class Replay:
    """One router's replayed top-k: `target` int64 `[tokens, top_k]` in the router's token
    order, -1 rows left to the router; None: the router's own choice everywhere."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # the model's layer (0-based, over every pipeline stage)
        self.target: torch.Tensor | None = None

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(top-k scores, top-k indices) of `scores` [tokens, experts]: the recorded experts
        where known, the router's own elsewhere."""
        probs, indices = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.target is None:
            return probs, indices
        target = self.target.to(scores.device)
        if target.shape != indices.shape:
            raise ValueError(f"routing replay, layer {self.layer}: recorded experts "
                             f"{list(target.shape)} for a router of {list(indices.shape)}")  # fmt: skip
        indices = merged(target, indices)
        return scores.gather(1, indices), indices


def attach(model: torch.nn.Module) -> list[Replay]:
    """A `Replay` in every MoE router of this rank's layers, in layer order (none for a
    dense model)."""
    replays = []
    for layer in _layers(model):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            router.router_replay = Replay(int(layer.layer_number) - 1)
            replays.append(router.router_replay)
    return replays


def _layers(model: torch.nn.Module) -> list[Any]:
    decoder = getattr(model, "decoder", None)
    return list(getattr(decoder, "layers", []))


@contextlib.contextmanager
def replayed(
    replays: list[Replay], routing: np.ndarray | None, *, tp_rank: int = 0, tp_size: int = 1
) -> Iterator[None]:
    """Each router replays `routing` [rows, width, layers, top_k] during the block: its
    layer's experts in Megatron's token order (sequence-major, `[width, rows]` flattened), of
    this tensor-parallel rank's slice of the sequence when `tp_size` > 1 (sequence
    parallelism). Nothing is replayed when `routing` is None."""
    if routing is None or not replays:
        yield
        return
    rows, width = routing.shape[:2]
    if width % tp_size:
        raise ValueError(f"routing replay: width {width} is not split over {tp_size} TP ranks")
    part = width // tp_size
    local = torch.from_numpy(routing[:, tp_rank * part : (tp_rank + 1) * part])
    try:
        for r in replays:
            r.target = local[:, :, r.layer].transpose(0, 1).reshape(part * rows, -1)
        yield
    finally:
        for r in replays:
            r.target = None
