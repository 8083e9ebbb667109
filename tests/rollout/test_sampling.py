"""`processed_logprobs` (the distribution the engine samples from) against a slow reference."""

from __future__ import annotations

import math

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyre.rollout.protocol import SamplingParams, parse_sampling
from gyre.rollout.sampling import next_token, processed_logprobs

from .reference import nucleus_is_ambiguous, slow_distribution

logit_rows = st.lists(
    st.floats(min_value=-20, max_value=20, allow_nan=False, width=32), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(
    logits=logit_rows,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]),
)
@example(
    logits=[1.0, -7.217413438794552e-29, 0.0], temperature=0.3, top_p=0.95
)  # a tie at the edge
def test_processed_logprobs_match_slow_reference(
    logits: list[float], temperature: float, top_p: float
) -> None:
    got = processed_logprobs(torch.tensor(logits), temperature=temperature, top_p=top_p)
    want = slow_distribution([float(x) for x in torch.tensor(logits)], temperature, top_p)
    row = [float(x) for x in torch.tensor(logits)]
    support = {i for i, v in enumerate(got.tolist()) if math.isfinite(v)}
    assert abs(sum(math.exp(v) for v in got.tolist() if math.isfinite(v)) - 1) < 1e-9
    if nucleus_is_ambiguous(row, temperature, top_p):
        return  # a token sits on the nucleus edge within float rounding: either side is right
    assert support == set(want)
    for i in support:
        assert abs(got[i].item() - want[i]) < 1e-9


@settings(max_examples=100, deadline=None)
@given(logits=logit_rows, allowed_bits=st.lists(st.booleans(), min_size=40, max_size=40))
def test_masked_distribution_is_renormalized_over_allowed(
    logits: list[float], allowed_bits: list[bool]
) -> None:
    allowed = torch.tensor(allowed_bits[: len(logits)])
    if not bool(allowed.any()):
        allowed[0] = True
    row = torch.tensor(logits)
    got = processed_logprobs(row, temperature=1.0, allowed=allowed)
    sub = torch.log_softmax(row.double()[allowed], dim=-1)
    assert torch.allclose(got[allowed], sub, atol=1e-9)
    assert bool(torch.isinf(got[~allowed]).all())


@settings(max_examples=100, deadline=None)
@given(logits=logit_rows, temperature=st.sampled_from([5e-324, 1e-308, 1e-300, 1e-30]))
def test_a_tiny_temperature_samples_the_argmax_not_nan(
    logits: list[float], temperature: float
) -> None:
    """Logits divided by a (valid) temperature near 0 overflow; sampling must still work, on
    the maximum (a fuzzed /v1/responses call once made the engine fail with NaN probabilities).
    Logits closer to the maximum than ~T (subnormal gaps at T = 1e-30) are near-ties: they may
    be drawn too, so the drawn token is one whose gap to the maximum is under 40 T."""
    row = torch.tensor(logits)
    got = processed_logprobs(row, temperature=temperature)
    assert not bool(torch.isnan(got).any())
    assert abs(sum(math.exp(v) for v in got.tolist() if math.isfinite(v)) - 1) < 1e-9
    gen = torch.Generator().manual_seed(0)
    token, _ = next_token(row, temperature=temperature, top_p=1, top_k=-1, allowed=None,
                          generator=gen)  # fmt: skip
    gap = (row.max().double() - row[token].double()) / temperature
    assert bool(gap < 40), (token, float(gap))


def test_greedy_picks_argmax_and_sampling_follows_the_distribution() -> None:
    row = torch.tensor([0.0, 2.0, 1.0, 2.0])
    token, lp = next_token(row, temperature=0, top_p=1, top_k=-1, allowed=None, generator=None)
    assert token == 1  # ties go to the lower id
    assert abs(lp - torch.log_softmax(row.double(), -1)[1].item()) < 1e-12
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0, 0]
    for _ in range(4000):
        t, _ = next_token(row, temperature=1.0, top_p=1, top_k=2, allowed=None, generator=gen)
        counts[t] += 1
    assert counts[0] == counts[2] == 0 and abs(counts[1] - 2000) < 200


@given(
    max_new_tokens=st.integers(0, 10_000),
    temperature=st.floats(0, 5),
    top_p=st.floats(0.01, 1),
    stop=st.lists(st.integers(0, 99), max_size=4),
)
def test_sampling_params_round_trip_through_the_wire(
    max_new_tokens: int, temperature: float, top_p: float, stop: list[int]
) -> None:
    sp = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop_token_ids=stop
    )
    assert parse_sampling(sp.to_json(), vocab_size=100) == sp
