"""Target log-probs through Megatron's vocab-parallel cross-entropy (the TP > 1 path of
`MegatronCell`), run here on a one-rank gloo tensor-parallel group against Gyre's reference
`target_logprobs`: float32 and bfloat16 logits (float32 log-probs either way), one row and
several, values and gradients."""

from __future__ import annotations

import pytest
import torch

from gyre.train.megatron.model import vocab_parallel_target_logprobs
from gyre.train.objective import target_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_vocab_parallel_logprobs_match_reference(megatron_world, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, 7, 50, generator=gen).to(dtype)
    ids = torch.randint(0, 50, (rows, 7), generator=gen)
    logits = base.clone().requires_grad_()
    got = vocab_parallel_target_logprobs(logits, ids)
    assert torch.equal(logits.detach(), base)  # the model's logits are left as they were
    ref_logits = base.clone().requires_grad_()
    want = target_logprobs(ref_logits.float(), ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # of the logits' gradient, in their dtype
    assert got.dtype == torch.float32 and got.shape == (rows, 7)  # as target_logprobs's
    assert torch.allclose(got, want, atol=1e-5)  # no rounding to bf16 of the log-probs
    weights = torch.randn(rows, 7, generator=gen)
    (got.float() * weights).sum().backward()
    (want * weights).sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    assert torch.allclose(logits.grad.float(), ref_logits.grad.float(), atol=tol)
