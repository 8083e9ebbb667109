"""Target log-probs from a vocabulary split over the tensor-parallel ranks (the TP > 1 path of
`MegatronCell`: `target_logprobs(..., vocab_shard=...)`, chunked, each chunk's statistics
all-reduced) against `target_logprobs` on the whole logits: on a one-rank gloo
tensor-parallel group through `vocab_parallel_target_logprobs`, and over two gloo processes
holding half the vocabulary each; float32 and bfloat16 logits (float32 log-probs either way), values and gradients."""

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


_RANK = """
import sys, torch, torch.distributed as dist
from gyre.train.objective import VocabShard, target_logprobs
rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
case = torch.load(f"{out}/case.pt")
results = {}
for name, logits in case["logits"].items():
    half = logits.shape[-1] // 2
    mine = logits[..., rank * half : (rank + 1) * half].clone().requires_grad_()
    shard = VocabShard(start=rank * half, size=half,
                       reduce=lambda t, op: dist.all_reduce(t, op=ops[op]))
    logp = target_logprobs(mine, case["ids"], chunk_tokens=5, vocab_shard=shard)
    (logp.float() * case["weights"]).sum().backward()
    results[name] = (logp.detach(), mine.grad)
torch.save(results, f"{out}/rank{rank}.pt")
dist.destroy_process_group()
"""


def test_chunked_logprobs_over_a_vocabulary_split_in_two(tmp_path) -> None:
    """TP = 2's path (two gloo processes, each holding half the vocabulary, several chunks
    per row): both ranks get the whole vocabulary's log-probs, and the two shards' gradients
    put side by side are the full logits' gradient, against `target_logprobs` on the whole
    logits; float32 and bfloat16 (targets in both halves)."""
    import subprocess
    import sys

    from processes import rendezvous

    gen = torch.Generator().manual_seed(0)
    base = 3 * torch.randn(3, 11, 40, generator=gen)
    case = {"logits": {"float32": base, "bfloat16": base.to(torch.bfloat16)},
            "ids": torch.randint(0, 40, (3, 11), generator=gen),
            "weights": torch.randn(3, 11, generator=gen)}  # fmt: skip
    assert (case["ids"] < 20).any() and (case["ids"] >= 20).any()
    torch.save(case, tmp_path / "case.pt")
    init = rendezvous(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), init, str(tmp_path)],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, logits in case["logits"].items():
        full = logits.clone().requires_grad_()
        want = target_logprobs(full, case["ids"], chunk_tokens=5)
        (want.float() * case["weights"]).sum().backward()
        tol = 1e-5 if name == "float32" else 2e-2
        for r in ranks:
            assert torch.allclose(r[name][0].float(), want.detach().float(), atol=tol), name
        grad = torch.cat([ranks[0][name][1], ranks[1][name][1]], dim=-1)
        assert full.grad is not None
        assert torch.allclose(grad.float(), full.grad.float(), atol=tol), name
