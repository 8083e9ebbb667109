"""Peak memory per token of a training row: its log-probs, and a Megatron step's attention.

    python tools/bench_memory.py [--json] [--quick] [--repeats N]          # log-probs
    python tools/bench_memory.py --attention [--json] [--rows 8192,32768,65536] [--tp 1,2]

What, default suite: the peak resident memory of one training row's forward + backward
through the target log-probs and the step loss `TorchCell.accumulate` backpropagates
(`step_loss(logp, coeff)`), in bytes per token, for 8k- and 64k-token rows and realistic
vocabularies (49152 as SmolLM2, 151936 as Qwen2), on CPU in float32. Paths:

* `logits/reference` — what Gyre did before: `log_softmax(logits)` + gather (the baseline,
  kept here, not in gyre/);
* `logits/chunked` — `gyre.train.objective.target_logprobs` (chunked forward and backward);
* `head/reference` — logits = hidden @ W.T from hidden states, then the reference;
* `head/chunked` — `gyre.train.objective.lm_head_target_logprobs`: each chunk's logits made
  from the hidden states inside the chunk, so no logits tensor exists at all.

`--attention`: one phase-B micro-step (`MegatronCell.accumulate`: forward, objective,
backward) of one row of 8k, 32k and 64k tokens through a tiny-width Megatron model
(`ATTENTION_MODEL`: one layer, hidden 16, two heads of 8, vocabulary 128, so the attention
is what grows), built by the backend's own `build_rank_model`, at TP 1 and TP 2 (two gloo
processes, the peak of the larger rank), with Megatron's `DotProductAttention` ("local",
before) and `SDPAttention` ("sdpa", after). A "local" case whose predicted peak
(`local_attention_bytes`: the causal mask, the scores buffer, the saved probabilities and
their gradients, all len x len) exceeds `--max-gb` is reported skipped with that prediction.

Why: a row's logits are `len x vocab` floats (8k x 152k x 4 B = 5 GB), and Megatron's local
attention holds `heads x len x len` floats per layer; either decides the longest row a
device can train.

How: every case runs in fresh subprocesses (`--child`, `--child-step`): each builds its
inputs, resets the kernel's peak-RSS counter (`/proc/self/clear_refs`, Linux), runs forward +
backward and reads `VmHWM`; the case's memory is that peak minus the RSS before the pass
(inputs and model included in neither; the logits' gradient is in both logits paths).
Cases whose peak would not fit this machine are skipped and reported as such (`--max-gb`,
default 20 for log-probs, 8 for attention). Single-threaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from peak_rss import kib as _kib  # noqa: E402 (the benches' one measurement)
from peak_rss import reset_peak  # noqa: E402

HIDDEN = 64  # hidden size of the head cases: small, so the matmuls stay affordable on CPU
PATHS = ("logits/reference", "logits/chunked", "head/reference", "head/chunked")
# full-size [len, vocab] float32 buffers alive at the peak, per path (for the fit check)
FULL_BUFFERS = {"logits/reference": 5, "logits/chunked": 2, "head/reference": 5, "head/chunked": 0}


def _reference_logprobs(logits: Any, ids: Any) -> Any:
    import torch

    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
    return torch.nn.functional.pad(picked.squeeze(-1), (1, 0))


def child(path: str, tokens: int, vocab: int) -> dict[str, Any]:
    """One case in this (fresh) process: bytes above the pre-pass RSS at the peak."""
    import torch

    from gyre.train.objective import lm_head_target_logprobs, step_loss, target_logprobs

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    coeff = torch.randn(1, tokens, generator=gen, dtype=torch.float64)
    if path.startswith("logits/"):
        x = torch.randn(1, tokens, vocab, generator=gen).requires_grad_(True)
        leaves = [x]
        fn = target_logprobs if path == "logits/chunked" else _reference_logprobs
        run = lambda: fn(x, ids)  # noqa: E731
    else:
        h = torch.randn(1, tokens, HIDDEN, generator=gen).requires_grad_(True)
        w = (0.1 * torch.randn(vocab, HIDDEN, generator=gen)).requires_grad_(True)
        leaves = [h, w]
        if path == "head/chunked":
            run = lambda: lm_head_target_logprobs(h, w, ids)  # noqa: E731
        else:
            run = lambda: _reference_logprobs(h @ w.T, ids)  # noqa: E731
    before = _kib("VmRSS")
    reset_peak()  # peak RSS := current RSS
    t0 = time.perf_counter()
    step_loss(run(), coeff).backward()
    seconds = time.perf_counter() - t0
    peak = _kib("VmHWM")
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    extra = (peak - before) * 1024
    return {"path": path, "tokens": tokens, "vocab": vocab, "extra_bytes": extra,
            "grad_bytes": grads, "bytes_per_token": extra / tokens, "seconds": seconds}  # fmt: skip


def run_case(path: str, tokens: int, vocab: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", path, str(tokens), str(vocab)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def fits(path: str, tokens: int, vocab: int, max_gb: float) -> bool:
    """Inputs plus the full-size buffers alive at the path's peak, under `max_gb`."""
    full = tokens * vocab * 4
    return (FULL_BUFFERS[path] * full + tokens * HIDDEN * 16) / 1e9 <= max_gb


def grid(quick: bool, cases: str | None) -> list[tuple[str, int, int]]:
    if cases:  # PATH:TOKENS:VOCAB,...
        picked = [c.split(":") for c in cases.split(",")]
        return [(p, int(t), int(v)) for p, t, v in picked]
    if quick:
        return [(p, 2048, 49152) for p in PATHS]
    out = []
    for vocab in (49152, 151936):
        for tokens in (2048, 8192, 65536):
            out += [(p, tokens, vocab) for p in PATHS]
    return out


# ----- a Megatron step's attention -------------------------------------------------------
ATTENTION_MODEL = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
                   "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
                   "vocab_size": 128, "max_position_embeddings": 131072,
                   "tie_word_embeddings": True}  # fmt: skip
"""The `--attention` cases' model: one layer, narrow, so the attention is what grows."""


def local_attention_bytes(tokens: int, tp: int) -> int:
    """Predicted peak of `DotProductAttention`'s len x len tensors on one rank (float32): the
    causal mask (bool), the scores buffer and each layer's saved probabilities, and in a
    layer's backward two more (the gradients of the probabilities and of the scores).
    At 8k tokens it is the local cases' measured peak less the sdpa cases' to 0.2 %."""
    heads = int(ATTENTION_MODEL["num_attention_heads"]) // tp
    layers = int(ATTENTION_MODEL["num_hidden_layers"])
    return tokens * tokens * (1 + 4 * heads * (1 + layers + 2))


def child_step(attention: str, tp: int, rank: int, tokens: int, port: int) -> dict[str, Any]:
    """One rank of one case: bytes above the pre-pass RSS at the peak of a phase-B step."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from gyre.train.config import ObjectiveConfig
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import (
        MegatronCell,
        build_gpt_model,
        build_rank_model,
        init_model_parallel,
    )
    from gyre.train.objective import ExecutionScalar
    from gyre.train.packing import MicroStep, TokenRow

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)  # fmt: skip
    cfg = MegatronConfig(tensor_parallel=tp, dtype="float32", attention=attention)  # type: ignore[arg-type]
    init_model_parallel(cfg, "cpu")
    gen = torch.Generator().manual_seed(rank)
    shapes = build_gpt_model(ATTENTION_MODEL, cfg, device="cpu").state_dict()
    weights = {k: 0.02 * torch.randn(v.shape, generator=gen) for k, v in shapes.items()
               if not k.endswith("_extra_state")}  # fmt: skip
    cell = MegatronCell(build_rank_model(ATTENTION_MODEL, weights, cfg, device="cpu"),
                        objective=ObjectiveConfig())  # fmt: skip
    ids = np.random.default_rng(0).integers(0, ATTENTION_MODEL["vocab_size"], tokens)
    targets = np.arange(tokens) >= 1
    row = TokenRow(execution_id="e", group_id="g", policy_version=0, ids=ids.astype(np.int64),
                   targets=targets, behaviour_logprobs=np.where(targets, -5.0, 0.0),
                   advantage=1.0, execution_targets=int(targets.sum()),
                   weights=targets / targets.sum())  # fmt: skip
    scalars = {"e": ExecutionScalar(advantage=1.0, num_targets=row.num_targets, log_ratio=0.0,
                                    gate=1.0)}  # fmt: skip
    step = MicroStep(index=0, rows=(row,))
    before = _kib("VmRSS")
    reset_peak()  # peak RSS := current RSS
    t0 = time.perf_counter()
    cell.accumulate(step, scalars)
    seconds = time.perf_counter() - t0
    extra = (_kib("VmHWM") - before) * 1024
    dist.destroy_process_group()
    return {"attention": attention, "tp": tp, "rank": rank, "tokens": tokens,
            "extra_bytes": extra, "seconds": seconds}  # fmt: skip


def run_step_case(attention: str, tp: int, tokens: int) -> dict[str, Any]:
    """One case over `tp` fresh processes: the larger rank's peak."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    procs = [subprocess.Popen([sys.executable, __file__, "--child-step", attention, str(tp),
                               str(rank), str(tokens), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(tp)]  # fmt: skip
    ranks = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"--child-step {attention} {tp} {tokens} failed:\n{err[-4000:]}")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    peak = max(r["extra_bytes"] for r in ranks)
    return {"attention": attention, "tp": tp, "tokens": tokens, "peak_bytes": peak,
            "bytes_per_token": peak / tokens, "seconds": max(r["seconds"] for r in ranks),
            "predicted_local_bytes": local_attention_bytes(tokens, tp)}  # fmt: skip


def attention_suite(rows: list[int], tps: list[int], max_gb: float) -> list[dict[str, Any]]:
    out = []
    for tp in tps:
        for tokens in rows:
            for attention in ("local", "sdpa"):
                predicted = local_attention_bytes(tokens, tp)
                if attention == "local" and predicted / 1e9 > max_gb:
                    out.append({"attention": attention, "tp": tp, "tokens": tokens,
                                "skipped": True, "predicted_local_bytes": predicted,
                                "predicted_bytes_per_token": predicted / tokens})  # fmt: skip
                    print(f"{attention:6} TP {tp} {tokens:6}  skipped: predicted "
                          f"{predicted / 1e9:.1f} GB > {max_gb} GB", file=sys.stderr, flush=True)  # fmt: skip
                    continue
                r = run_step_case(attention, tp, tokens)
                out.append(r)
                print(f"{attention:6} TP {tp} {tokens:6}  {r['bytes_per_token']:10.0f} B/token  "
                      f"(peak {r['peak_bytes'] / 1e9:.3f} GB, {r['seconds']:.1f} s; local "
                      f"predicted {predicted / 1e9:.3f} GB)", file=sys.stderr, flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2k tokens, one vocabulary")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--max-gb",
        type=float,
        default=None,
        help="largest predicted peak to run (default 20 GB; 8 with --attention)",
    )
    ap.add_argument("--cases", help="PATH:TOKENS:VOCAB,... instead of the default grid")
    ap.add_argument(
        "--attention",
        action="store_true",
        help="a Megatron step's attention, local vs sdpa, instead of the log-probs",
    )
    ap.add_argument("--rows", default="8192,32768,65536", help="--attention row lengths")
    ap.add_argument("--tp", default="1,2", help="--attention tensor-parallel sizes")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "TOKENS", "VOCAB"))
    ap.add_argument("--child-step", nargs=5, metavar=("ATTENTION", "TP", "RANK", "TOKENS", "PORT"))
    args = ap.parse_args()
    if args.child:
        path, tokens, vocab = args.child
        print(json.dumps(child(path, int(tokens), int(vocab))))
        return 0
    if args.child_step:
        attention, tp, rank, tokens, port = args.child_step
        print(json.dumps(child_step(attention, int(tp), int(rank), int(tokens), int(port))))
        return 0
    if args.attention:
        found = attention_suite([int(r) for r in args.rows.split(",")],
                                [int(t) for t in args.tp.split(",")],
                                8.0 if args.max_gb is None else args.max_gb)  # fmt: skip
        if args.json:
            print(json.dumps(found, indent=1))
        return 0
    args.max_gb = 20.0 if args.max_gb is None else args.max_gb
    rows = []
    for path, tokens, vocab in grid(args.quick, args.cases):
        if not fits(path, tokens, vocab, args.max_gb):
            rows.append({"path": path, "tokens": tokens, "vocab": vocab, "skipped": True})
            print(f"{path:18} {tokens:6} {vocab:7}  does not fit in {args.max_gb} GB",
                  file=sys.stderr)  # fmt: skip
            continue
        runs = [run_case(path, tokens, vocab) for _ in range(args.repeats)]
        per = [r["bytes_per_token"] for r in runs]
        grad = runs[0]["grad_bytes"] / tokens
        secs = [r["seconds"] for r in runs]
        rows.append({"path": path, "tokens": tokens, "vocab": vocab, "bytes_per_token": per,
                     "grad_bytes_per_token": grad, "seconds": secs})  # fmt: skip
        print(f"{path:18} {tokens:6} {vocab:7}  {min(per):12.0f} .. {max(per):12.0f} B/token"
              f"  (gradients of the inputs: {grad:.0f} B/token; {min(secs):.1f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
