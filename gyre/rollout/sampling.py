"""The distribution the engine samples from, and its behaviour log-probs.

One function, `processed_logprobs`, turns a row of next-token logits into the log-probs of
the distribution that is actually sampled from, so the log-prob Gyre records for a sampled
token is exactly log π_behaviour(token | context):

1. tokens outside `allowed` (regex constraint) get -inf;
2. temperature T > 0: logits / T; T == 0 (greedy) keeps the raw logits (T = 1);
3. top_k: keep the k largest (ties broken towards the lower token id);
4. top_p: sort by probability (descending, ties by token id), keep a token when the mass
   of the tokens ranked strictly before it is < top_p (so the top token is always kept);
5. renormalize over the kept tokens (log_softmax over them, -inf elsewhere).

Greedy decoding picks the argmax (lowest id on ties) and reports its log-prob under the
processed T = 1 distribution (steps 1, 3, 4, 5 with T = 1), not log 1 = 0: a
greedy call's log-probs then still say how confident the policy was.

The log-prob *reported* for a token is the model's own, `policy_logprobs` (raw logits, T = 1,
no mask, float64), for sampled tokens and for scored input tokens alike; only the embedded
engine's SGLang emulation (`logprobs_under_grammar: masked`) passes the grammar mask to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def processed_logprobs(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs (float64, -inf outside the support) of the distribution sampled from."""
    z = logits.to(torch.float64)
    if allowed is not None:  # grammar masks are built on the host
        z = z.masked_fill(~allowed.to(z.device), float("-inf"))
    if temperature > 0:  # shifted first: a tiny T sends the others to -inf, never to +inf/NaN
        top = z.max()
        z = (z - top) / temperature if bool(torch.isfinite(top)) else z / temperature
    keep = torch.isfinite(z)
    if not (0 < top_k < z.numel()) and top_p >= 1.0:
        return torch.log_softmax(z, dim=-1).masked_fill(~keep, float("-inf"))
    order = _rank_order(z)
    ranked = z[order]
    if 0 < top_k < z.numel():
        keep_ranked = torch.zeros_like(keep)
        keep_ranked[:top_k] = True
        ranked = ranked.masked_fill(~keep_ranked, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(ranked, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        ranked = ranked.masked_fill(before >= top_p, float("-inf"))
    out = torch.full_like(z, float("-inf"))
    out[order] = torch.log_softmax(ranked, dim=-1)
    return out.masked_fill(~keep, float("-inf"))


def _rank_order(z: torch.Tensor) -> torch.Tensor:
    """Token ids by descending value, ties by ascending id (a stable sort)."""
    return torch.sort(z, descending=True, stable=True).indices


def choose(logprobs: torch.Tensor, *, greedy: bool, generator: torch.Generator | None) -> int:
    """Pick a token from processed log-probs: argmax if greedy, else a sample."""
    if greedy:
        return int(torch.argmax(logprobs))  # the first maximum: lowest id on ties
    probs = torch.exp(logprobs)
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    allowed: torch.Tensor | None,
    generator: torch.Generator | None,
    masked_logprob: bool = False,
) -> tuple[int, float]:
    """Sample one token from one row of logits; return (token id, behaviour log-prob).

    `masked_logprob`: report the log-prob over the `allowed` tokens only (SGLang's reporting
    of constrained calls, emulated for tests) instead of the model's own."""
    lp = processed_logprobs(
        logits,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=top_p,
        top_k=top_k,
        allowed=allowed,
    )
    token = choose(lp, greedy=temperature == 0, generator=generator)
    return token, policy_logprob(logits, token, allowed=allowed if masked_logprob else None)


def policy_logprob(
    logits: torch.Tensor, token: int, *, allowed: torch.Tensor | None = None
) -> float:
    """log π(token | context) of the model itself for one row of logits (`policy_logprobs`)."""
    return policy_logprobs(logits.unsqueeze(0), [token], allowed=allowed)[0]


def policy_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], *, allowed: torch.Tensor | None = None
) -> list[float]:
    """log π(tokens[i] | context) of the model itself, from logits row i [n, vocab]: raw
    logits, T = 1, no truncation, float64.

    This is the behaviour log-prob the engine reports, for sampled and scored input tokens
    alike: the very quantity the trainer recomputes for the same token
    (`gyre.train.objective.target_logprobs`), so importance ratios measure how far the
    policy moved since sampling and nothing else. `allowed` (one row only) renormalizes
    over a grammar's tokens: what SGLang reports for constrained calls (docs/engine.md
    "Behaviour log-probs"), emulated by the embedded engine's masked mode for tests.
    """
    z = logits.to(torch.float64)
    if allowed is not None:
        z = z.masked_fill(~allowed.to(z.device), float("-inf"))
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=z.device)
    picked = torch.log_softmax(z, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return [float(x) for x in picked.tolist()]
