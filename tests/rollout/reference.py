"""Slow, obvious references for the engine's numbers (no batching, no cache, plain loops)."""

from __future__ import annotations

import math
from typing import Any

import torch


def slow_distribution(logits: list[float], temperature: float, top_p: float) -> dict[int, float]:
    """token -> log-prob of the distribution sampled from (see gyre.rollout.sampling)."""
    t = temperature if temperature > 0 else 1.0
    z = [x / t for x in logits]
    m = max(z)
    exps = [math.exp(x - m) for x in z]
    total = sum(exps)
    probs = [e / total for e in exps]
    order = sorted(range(len(probs)), key=lambda i: (-z[i], i))  # probability order
    kept: list[int] = []
    mass = 0.0
    for i in order:
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    norm = sum(probs[i] for i in kept)
    return {i: math.log(probs[i] / norm) for i in kept}


def nucleus_is_ambiguous(logits: list[float], temperature: float, top_p: float) -> bool:
    """True if either side of the nucleus edge is right within float rounding: some token's
    preceding mass is within rounding of top_p, or the last token kept and the first one cut
    tie within rounding (which of two equal tokens is kept is arbitrary; seen: logits
    [1, -7e-29, 0] at T 0.3, whose last two tie once shifted by the maximum)."""
    t = temperature if temperature > 0 else 1.0
    m = max(x / t for x in logits)
    exps = sorted((math.exp(x / t - m) for x in logits), reverse=True)
    total = sum(exps)
    mass = 0.0
    for k, e in enumerate(exps):
        if abs(mass - top_p) < 1e-9:
            return True
        if top_p < 1.0 and mass >= top_p:  # k is the first token cut
            return math.isclose(exps[k - 1], e, rel_tol=1e-12)
        mass += e / total
    return False


def reference_logits(model: Any, context: list[int], output: list[int]) -> list[list[float]]:
    """Next-token logits before each output token, from one plain forward pass."""
    ids = torch.tensor([context + output[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double()
    first = len(context) - 1
    return [logits[first + k].tolist() for k in range(len(output))]
