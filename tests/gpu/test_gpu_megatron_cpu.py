"""Megatron-core forward and backward on this CPU (gyre.train.megatron.cpu's four patches):
Gyre's GPTModel of the tiny Qwen2 against transformers' own model at TP = 2, PP = 2 and
TP 2 x PP 2 over gloo processes (vocab-parallel cross-entropy; the stages' hidden states
and input gradients sent stage to stage, the tied embedding's two copies summed; shards
gathered back to the Hugging Face layout). And the patches stay off where CUDA is present."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.train.packing import MicroStep, TokenRow

pytest.importorskip("megatron.core", reason="megatron-core not installed (extra gyre[gpu])")
WORKER = Path(__file__).with_name("megatron_tp_worker.py")


def _step(lengths: tuple[int, ...] = (12, 7, 9)) -> MicroStep:
    gen = np.random.default_rng(0)
    rows = []
    for k, n in enumerate(lengths):
        targets = np.arange(n) >= n // 2
        rows.append(TokenRow(
            execution_id=f"e{k}", group_id="g0", policy_version=0,
            ids=gen.integers(0, 4096, n).astype(np.int64), targets=targets,
            behaviour_logprobs=np.where(targets, -1.0, 0.0), advantage=1.0,
            execution_targets=int(targets.sum()), weights=targets / targets.sum(),
        ))  # fmt: skip
    return MicroStep(index=0, rows=tuple(rows))


def _hf_reference(step: MicroStep) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' tiny Qwen2: target log-probs and the gradient of their sum."""
    from gyre.models import load_model
    from gyre.train.objective import step_tensors, target_logprobs

    hf, _ = load_model("tiny")
    hf.train()
    st = step_tensors(step)
    logp = target_logprobs(hf(input_ids=st.ids, attention_mask=st.attention).logits, st.ids)
    (logp * st.targets).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# TP = 1, PP = 1: test_gpu_megatron_weights.py, in-process
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_megatron_tp_matches_transformers_on_cpu(tmp_path: Path, tp: int, pp: int) -> None:
    from gyre.models import load_model
    from gyre.train.megatron.weights import WeightLayout, stages_to_hf

    step = _step()
    torch.save(step, tmp_path / "step.pt")
    port, world = _free_port(), tp * pp
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port),
                               str(tmp_path), str(pp)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert all(r["patched"] for r in ranks)  # the CPU patches were in force
    want_logp, want_grads = _hf_reference(step)
    targets = torch.from_numpy(np.zeros(want_logp.shape, bool))
    for k, row in enumerate(step.rows):
        targets[k, : row.length] = torch.from_numpy(row.targets)
    for r in ranks:  # every rank has the whole rows' log-probs (vocab-parallel CE, broadcast)
        assert (r["logp"][targets] - want_logp[targets]).abs().max() < 2e-5
    hf_config = load_model("tiny")[0].config.to_dict()
    got = stages_to_hf([r["grads"] for r in ranks], WeightLayout.from_hf_config(hf_config),
                       tp_size=tp)  # fmt: skip
    assert set(got) == set(want_grads) - {"lm_head.weight"}  # tied to the embedding
    for name, g in got.items():
        ref = want_grads[name]
        assert float((g - ref).norm()) <= 1e-4 * float(ref.norm()) + 1e-7, name


@pytest.mark.slow
def test_the_cpu_patches_stay_off_where_cuda_is_present() -> None:
    probe = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding\n"
        "from megatron.core.models.common.language_module.language_module import LanguageModule\n"
        "before = RotaryEmbedding.get_emb, LanguageModule.setup_embeddings_and_output_layer\n"
        "from gyre.train.megatron import cpu\n"
        "on = cpu.enable()\n"
        "after = RotaryEmbedding.get_emb, LanguageModule.setup_embeddings_and_output_layer\n"
        "print(on, cpu.active(), all(a is b for a, b in zip(before, after)))\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True"]
