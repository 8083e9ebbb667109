"""Peak memory per token of the training objective's log-probs: full log-softmax vs chunked.

    python tools/bench_memory.py [--json] [--quick] [--repeats N]

What: the peak resident memory of one training row's forward + backward through the target
log-probs and the step loss `TorchCell.accumulate` backpropagates (`step_loss(logp, coeff)`),
in bytes per token, for 8k- and 64k-token rows and realistic vocabularies (49152 as SmolLM2,
151936 as Qwen2), on CPU in float32. Paths:

* `logits/reference` — what Gyre did before: `log_softmax(logits)` + gather (the baseline,
  kept here, not in gyre/);
* `logits/chunked` — `gyre.train.objective.target_logprobs` (chunked forward and backward);
* `head/reference` — logits = hidden @ W.T from hidden states, then the reference;
* `head/chunked` — `gyre.train.objective.lm_head_target_logprobs`: each chunk's logits made
  from the hidden states inside the chunk, so no logits tensor exists at all.

Why: a row's logits are `len x vocab` floats (8k x 152k x 4 B = 5 GB); the full log-softmax
and its gradient buffers multiply that, which decides the longest row a device can train.

How: every case runs in a fresh subprocess (`--child`): it builds its inputs, resets the
kernel's peak-RSS counter (`/proc/self/clear_refs`, Linux), runs forward + backward and reads
`VmHWM`; the case's memory is that peak minus the RSS before the pass (inputs included in
neither; the logits' gradient is in both logits paths). Cases whose peak would not fit this
machine are skipped and reported as such (`--max-gb`, default 20). Single-threaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 64  # hidden size of the head cases: small, so the matmuls stay affordable on CPU
PATHS = ("logits/reference", "logits/chunked", "head/reference", "head/chunked")
# full-size [len, vocab] float32 buffers alive at the peak, per path (for the fit check)
FULL_BUFFERS = {"logits/reference": 5, "logits/chunked": 2, "head/reference": 5, "head/chunked": 0}


def _kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", text)
    assert match is not None, field
    return int(match.group(1))


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
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2k tokens, one vocabulary")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-gb", type=float, default=20.0)
    ap.add_argument("--cases", help="PATH:TOKENS:VOCAB,... instead of the default grid")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "TOKENS", "VOCAB"))
    args = ap.parse_args()
    if args.child:
        path, tokens, vocab = args.child
        print(json.dumps(child(path, int(tokens), int(vocab))))
        return 0
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
