"""Model families through the one HF ↔ Megatron mapping: Qwen3 dense, Qwen3-MoE, Qwen2-MoE.

Each family's tiny random model (transformers' own class, built from a config in code:
megatron_family_worker.py's `tiny_family`) is cut into Megatron shards, built by the backend's
`build_rank_model` at TP 1 and TP 2 (sequence parallel, the default, and for Qwen3 also not;
Qwen3-MoE also at PP 2) over gloo processes, and run
through `MegatronCell`: logits, target log-probs and the gradients of their sum within 1e-5
relative of transformers', and the weights read back from the built model equal to the HF
tensors bit for bit. Besides: the config mapping (per-head q/k norm → `qk_layernorm`,
explicit `head_dim` → `kv_channels`, router / experts / top-k / renormalized top-k / shared
expert and its gate / the aux-loss coefficient), the checkpoint's per-expert tensors read
from the safetensors files as from transformers' stacked ones in memory, and the one-line
error for a family the mapping does not know.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from processes import rendezvous

from gyre.errors import ConfigError
from gyre.train.megatron.config import (
    SUPPORTED_MODEL_TYPES,
    MegatronConfig,
    check_trainable,
    num_experts,
    transformer_kwargs,
)
from gyre.train.megatron.weights import (
    WeightLayout,
    hf_to_mcore,
    mcore_to_hf,
    module_names,
    stage_to_mcore,
    stages_to_hf,
)
from gyre.train.packing import MicroStep
from gyre.train.synthetic import random_step

WORKER = Path(__file__).with_name("megatron_family_worker.py")
sys.path.insert(0, str(WORKER.parent))
from megatron_family_worker import tiny_family  # noqa: E402

SHAPES = Path(__file__).resolve().parents[2] / "templates" / "shapes"
QWEN3_8B = json.loads((SHAPES / "qwen3-8b" / "config.json").read_text())
QWEN3_30B_A3B = json.loads((SHAPES / "qwen3-30b-a3b" / "config.json").read_text())
QWEN2_57B_A14B = {
    "model_type": "qwen2_moe", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
    "vocab_size": 151936, "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip


# --- the config mapping -----------------------------------------------------------------------


def test_qwen3_maps_qk_norm_head_dim_and_no_bias():
    tk = transformer_kwargs(QWEN3_8B, MegatronConfig(tensor_parallel=2))
    assert tk["qk_layernorm"] and not tk["add_qkv_bias"]
    assert tk["kv_channels"] == 128 and tk["num_query_groups"] == 8
    assert "num_moe_experts" not in tk
    # head_dim need not be hidden / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128)
    small = {**QWEN3_8B, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 3072}
    assert transformer_kwargs(small, MegatronConfig())["kv_channels"] == 128
    lay = WeightLayout.from_hf_config(QWEN3_8B)
    assert lay.qk_norm and not lay.qkv_bias and lay.head_dim == 128 and not lay.experts


def test_moe_families_map_router_experts_and_shared_expert():
    tk = transformer_kwargs(QWEN3_30B_A3B, MegatronConfig())
    assert tk["num_moe_experts"] == 128 and tk["moe_router_topk"] == 8
    assert tk["moe_ffn_hidden_size"] == 768 and tk["qk_layernorm"]
    # HF: softmax over all experts, top k, renormalized → Megatron's softmax over the top k
    assert tk["moe_router_pre_softmax"] is False
    assert tk["moe_shared_expert_intermediate_size"] is None
    assert tk["moe_aux_loss_coeff"] == 0 and tk["moe_router_load_balancing_type"] == "none"
    assert tk["moe_token_dispatcher_type"] == "allgather" and not tk["moe_grouped_gemm"]
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
    saved = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert transformer_kwargs({**saved, "num_local_experts": 128}, MegatronConfig())[
        "num_moe_experts"] == 128  # fmt: skip
    tk = transformer_kwargs(QWEN2_57B_A14B, MegatronConfig(moe_aux_loss_coeff=1e-3))
    assert tk["moe_router_pre_softmax"] is True  # plain top-k softmax probabilities
    assert tk["moe_shared_expert_intermediate_size"] == 20480 and tk["moe_shared_expert_gate"]
    assert tk["add_qkv_bias"] and not tk["qk_layernorm"]
    assert tk["moe_aux_loss_coeff"] == 1e-3 and tk["moe_router_load_balancing_type"] == "aux_loss"
    lay = WeightLayout.from_hf_config(QWEN2_57B_A14B)
    assert lay.experts == 64 and lay.shared_expert and lay.qkv_bias and not lay.qk_norm


def test_expert_parallelism_folds_onto_the_tensor_parallel_ranks():
    """EP x ETP = TP inside a cell: Megatron's expert sizes follow, a routed expert's width
    need divide ETP only; an EP that does not divide TP or the experts, or a dense model at
    EP > 1, is one line naming the value and what is allowed."""
    tk = transformer_kwargs(QWEN3_30B_A3B, MegatronConfig(tensor_parallel=4, expert_parallel=2))
    assert tk["expert_model_parallel_size"] == 2 and tk["expert_tensor_parallel_size"] == 2
    assert transformer_kwargs(QWEN3_30B_A3B, MegatronConfig(tensor_parallel=2))[
        "expert_tensor_parallel_size"] == 2  # fmt: skip
    narrow = {**QWEN3_30B_A3B, "moe_intermediate_size": 770}  # 770 = 2 x 385
    check_trainable(narrow, MegatronConfig(tensor_parallel=4, expert_parallel=2))
    with pytest.raises(ConfigError, match="expert_parallel: 3 does not divide tensor_parallel 4"):
        MegatronConfig(tensor_parallel=4, expert_parallel=3)
    with pytest.raises(ConfigError) as e:
        check_trainable({**QWEN3_30B_A3B, "num_experts": 6},
                        MegatronConfig(tensor_parallel=4, expert_parallel=4))  # fmt: skip
    assert "\n" not in str(e.value)
    assert "expert_parallel: 4 does not divide the 6 routed experts" in str(e.value)
    with pytest.raises(ConfigError, match="expert_parallel: 2 for a qwen3 model, which has no "
                                          "routed experts; allowed: 1"):  # fmt: skip
        check_trainable(QWEN3_8B, MegatronConfig(tensor_parallel=2, expert_parallel=2))


def test_an_unknown_family_is_one_line_naming_the_supported_ones():
    with pytest.raises(ConfigError) as e:
        check_trainable({**QWEN3_8B, "model_type": "deepseek_v3"}, MegatronConfig())
    msg = str(e.value)
    assert "\n" not in msg and "model_type: 'deepseek_v3'" in msg
    assert all(family in msg for family in SUPPORTED_MODEL_TYPES)
    assert set(SUPPORTED_MODEL_TYPES) >= {"qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"}


def test_moe_layouts_megatron_cannot_run_here_are_named():
    check_trainable(QWEN3_30B_A3B, MegatronConfig(tensor_parallel=2))  # sequence parallel
    with pytest.raises(
        ConfigError,
        match=r"sequence_parallel: false at tensor_parallel 2 for a "
        r"qwen3_moe model; allowed: sequence parallelism on \(true or null\)",
    ):
        check_trainable(QWEN3_30B_A3B, MegatronConfig(tensor_parallel=2, sequence_parallel=False))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        check_trainable({**QWEN3_30B_A3B, "mlp_only_layers": [0]}, MegatronConfig())
    with pytest.raises(ConfigError, match="moe_intermediate_size: 770 not divisible"):
        check_trainable({**QWEN3_30B_A3B, "moe_intermediate_size": 770},
                        MegatronConfig(tensor_parallel=4))  # fmt: skip
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff"):
        MegatronConfig(moe_aux_loss_coeff=-1.0)
    top1 = {**QWEN3_30B_A3B, "num_experts_per_tok": 1}
    with pytest.raises(ConfigError, match="num_experts_per_tok: 1 with norm_topk_prob true"):
        check_trainable(top1, MegatronConfig())
    check_trainable({**top1, "norm_topk_prob": False}, MegatronConfig())


# --- weights: checkpoint files and transformers' modules ---------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2_moe"])
def test_the_files_and_the_model_in_memory_give_the_same_shards(tmp_path, family):
    """`save_pretrained` writes a routed expert's tensors one by one
    (``mlp.experts.{j}.gate_proj.weight``, the checkpoints' and SGLang's names) while
    transformers 5 holds them stacked: each TP rank's shard is the same bytes from either, the
    shards gather back to the files' tensors exactly, and `module_names` stacks them back into
    the model's own state dict; at TP 1 and 2 and, for MoE models, with the 4 experts split
    over TP 2 as EP 2 (two whole experts a rank)."""
    from safetensors.torch import load_file

    from gyre.train.megatron.shard_files import SafetensorsFiles

    model = tiny_family(family)
    model.save_pretrained(tmp_path)
    on_disk, in_memory = load_file(tmp_path / "model.safetensors"), model.state_dict()
    hfc = model.config.to_dict()
    layouts = [(1, 1), (2, 1)] + ([(2, 2)] if "moe" in family else [])
    for tp, ep in layouts:
        lay = WeightLayout.from_hf_config(hfc, expert_parallel=ep)
        shards = [hf_to_mcore(in_memory, lay, tp_rank=r, tp_size=tp) for r in range(tp)]
        for r, shard in enumerate(shards):
            files = stage_to_mcore(SafetensorsFiles(tmp_path), lay, tp_rank=r, tp_size=tp,
                                   stage=0, stages=1)  # fmt: skip
            assert list(files) == list(shard)
            assert all(torch.equal(files[k], shard[k]) for k in shard)
        back = mcore_to_hf(shards, lay)
        assert set(back) == set(on_disk)
        assert all(torch.equal(back[k], on_disk[k]) for k in back)
        mine = module_names(back, lay)
        assert set(mine) == set(in_memory)
        assert all(torch.equal(mine[k], in_memory[k]) for k in mine)


def test_a_checkpoint_of_expert_parallel_shards_reassembles_as_the_model(tmp_path):
    """The per-rank checkpoint files of a TP 2 EP 2 cell (each rank its own two experts,
    Megatron's parameter order, the layout with its EP size in the header) put together
    (`core_file.load`: what a resume at other sizes, a torch core and `gyre eval` read) give
    the model's own parameters bit for bit, named as the model names them (its experts
    stacked), the AdamW moments in the same order."""
    import dataclasses

    from gyre.train import core_file

    model = tiny_family("qwen3_moe")
    lay = WeightLayout.from_hf_config(model.config.to_dict(), expert_parallel=2)
    state = dict(model.state_dict())
    order = [n for n, _ in model.named_parameters()]
    for rank in range(2):
        shard = stage_to_mcore(state, lay, tp_rank=rank, tp_size=2, stage=0, stages=1)
        flat = torch.cat([t.reshape(-1) for t in shard.values()])
        meta = {"version": 3, "shard": rank, "tensor": 2, "pipeline": 1,
                "names": [[n, list(t.shape)] for n, t in shard.items()],
                "layout": dataclasses.asdict(lay), "param_groups": [], "hf_order": order}  # fmt: skip
        core_file.save_shard(tmp_path, rank, {"main": flat, "exp_avg": 2 * flat,
                                              "exp_avg_sq": flat.square(),
                                              "step": torch.tensor(3.0)}, meta)  # fmt: skip
    assert core_file.expert(core_file.shard_meta(tmp_path, 1)) == 2
    data = core_file.load(tmp_path)
    assert [n for n, _ in data["named"]] == order
    assert all(torch.equal(t, state[n]) for n, t in data["named"])
    weights = core_file.weights(tmp_path)  # the weights alone: a resumed standalone engine's
    assert [n for n, _ in weights] == order
    assert all(torch.equal(t, state[n]) for n, t in weights)
    flat = torch.cat([state[n].reshape(-1) for n in order])
    moments = data["optimizer"]["state"][0]
    assert torch.equal(moments["exp_avg"], 2 * flat)
    assert torch.equal(moments["exp_avg_sq"], flat.square())


def _save_cell(folder: Path, model: torch.nn.Module, lay: WeightLayout, tp: int, pp: int) -> None:
    """`model` as the per-rank checkpoint files of a TP `tp` x PP `pp` cell (moments 2x and
    the square of the weights)."""
    import dataclasses

    from gyre.train import core_file

    state = dict(model.state_dict())
    order = [n for n, _ in model.named_parameters()]
    for rank in range(tp * pp):
        shard = stage_to_mcore(state, lay, tp_rank=rank % tp, tp_size=tp, stage=rank // tp,
                               stages=pp)  # fmt: skip
        flat = torch.cat([t.reshape(-1) for t in shard.values()])
        meta = {"version": 3, "shard": rank, "tensor": tp, "pipeline": pp,
                "names": [[n, list(t.shape)] for n, t in shard.items()],
                "layout": dataclasses.asdict(lay), "param_groups": [], "hf_order": order}  # fmt: skip
        core_file.save_shard(folder, rank, {"main": flat, "exp_avg": 2 * flat,
                                            "exp_avg_sq": flat.square(),
                                            "step": torch.tensor(3.0)}, meta)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "tp", "pp", "ep"),
    [("qwen3", 2, 2, 1), ("qwen3_tied", 1, 2, 1), ("qwen3_moe", 2, 1, 2), ("qwen2_moe", 1, 2, 1)],
)
def test_a_resume_at_other_sizes_reads_a_layer_at_a_time_what_the_whole_model_gives(
    tmp_path: Path, family: str, tp: int, pp: int, ep: int
) -> None:
    """A Megatron rank resuming a checkpoint taken at other sizes splits each buffer to its
    shard from `core_file.source` (the files' ranges of one layer at a time): every rank of
    every other layout gets bit for bit the shard it would cut from the whole model put
    together (`core_file.assembled`), for the weights and each moment, while the source held
    at most one layer's tensors (the embedding's group, the largest here) — never the model."""
    import dataclasses

    from gyre.train import core_file

    model = tiny_family(family)
    lay = WeightLayout.from_hf_config(model.config.to_dict(), expert_parallel=ep)
    _save_cell(tmp_path, model, lay, tp, pp)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "layers" not in n
    )
    targets = [(t, p) for t in (1, 2) for p in (1, 2) if (t, p) != (tp, pp)]
    for key in ("main", "exp_avg", "exp_avg_sq"):
        hf = core_file.assembled(tmp_path, key)
        for t, p in targets:
            target = dataclasses.replace(lay, expert_parallel=1)
            for rank in range(t * p):
                where = {"tp_rank": rank % t, "tp_size": t, "stage": rank // t, "stages": p}
                src = core_file.source(tmp_path, key)
                got = stage_to_mcore(src, target, **where)
                want = stage_to_mcore(hf, target, **where)
                assert list(got) == list(want), (key, t, p, rank)
                assert all(torch.equal(got[n], want[n]) for n in want), (key, t, p, rank)
                assert 0 < src.peak_bytes <= max(largest, whole // lay.num_layers), src.peak_bytes
                assert src.peak_bytes < whole / 2


# --- against transformers, through Megatron's GPTModel --------------------------------------


def _step(vocab: int) -> MicroStep:  # an odd width: sequence parallelism pads it
    return random_step(np.random.default_rng(0), (13, 7, 9), vocab=vocab)


def _run_world(
    workers: Any,
    tmp_path: Path,
    step: MicroStep,
    family: str,
    tp: int,
    attention: str,
    pp: int,
    sequence: str = "auto",
    ep: int = 1,
) -> list:
    torch.save(step, tmp_path / "step.pt")
    init = rendezvous(tmp_path)
    procs = [subprocess.Popen(workers.command(WORKER, r, tp * pp, init, tmp_path, family,
                                              attention, pp, sequence, ep),
                              env=workers.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(tp * pp)]  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(tp * pp)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,attention,pp,sequence,ep", [
    ("qwen3", 1, "sdpa", 1, "auto", 1), ("qwen3", 2, "sdpa", 1, "auto", 1),
    ("qwen3", 2, "sdpa", 1, "off", 1), ("qwen3", 2, "local", 1, "auto", 1),
    ("qwen3_tied", 2, "sdpa", 1, "auto", 1), ("qwen3_moe", 1, "sdpa", 1, "auto", 1),
    ("qwen3_moe_plain_topk", 1, "local", 1, "auto", 1), ("qwen2_moe", 1, "sdpa", 1, "auto", 1),
    ("qwen3_moe", 1, "sdpa", 2, "auto", 1), ("qwen3_moe", 2, "sdpa", 1, "auto", 1),
    ("qwen3_moe_plain_topk", 2, "local", 1, "auto", 1), ("qwen2_moe", 2, "sdpa", 1, "auto", 1),
    ("qwen3_moe", 2, "sdpa", 1, "auto", 2), ("qwen2_moe", 2, "sdpa", 1, "auto", 2),
])  # fmt: skip
def test_a_family_matches_transformers(workers, tmp_path, family, tp, attention, pp, sequence, ep):
    """Gyre's Megatron model of the family, TP ranks (and pipeline stages) over gloo, against
    transformers' model of the same weights: logits (PP 1: gathered over the vocabulary
    shards), target log-probs on every rank and every parameter's gradient (gathered back to
    HF names) within 1e-5 relative; the weights the ranks loaded gather back to
    transformers' state dict bit for bit. At TP 2 sequence parallelism is on ("auto") unless
    "off" (mixture-of-experts models: on only): the 13-token rows padded to 14, the
    norms', routers' and shared-expert gates' gradients summed over the TP ranks. With EP 2
    each TP rank holds two whole experts (tokens dispatched over the TP x EP ranks by
    all-gather, gloo), their gradients its own."""
    from gyre.train.objective import step_tensors, target_logprobs

    hf = tiny_family(family)
    step = _step(hf.config.vocab_size)
    ranks = _run_world(workers, tmp_path, step, family, tp, attention, pp, sequence, ep)
    assert {r["sequence_parallel"] for r in ranks} == {tp > 1 and sequence != "off"}
    experts = num_experts(hf.config.to_dict()) // ep  # a rank's routed experts in a layer
    assert all(sum(".local_experts." in n and "fc2" in n for n in r["grads"]) == 2 * experts // pp
               for r in ranks)  # fmt: skip
    hf.train()
    st = step_tensors(step)
    logits = hf(input_ids=st.ids, attention_mask=st.attention).logits
    logp = target_logprobs(logits, st.ids)
    (logp * st.targets).sum().backward()
    real = st.attention.bool()
    if pp == 1:
        got_logits = torch.cat([r["logits"] for r in ranks], dim=-1)
        assert _rel(got_logits[real], logits.detach()[real]) < 1e-5
    for r in ranks:
        assert _rel(r["logp"][st.targets], logp.detach()[st.targets]) < 1e-5
    lay = WeightLayout.from_hf_config(hf.config.to_dict(), expert_parallel=ep)
    grads = module_names(stages_to_hf([r["grads"] for r in ranks], lay, tp_size=tp), lay)
    want = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        assert _rel(g, want[name]) < 1e-5, name
    weights = module_names(stages_to_hf([r["weights"] for r in ranks], lay, tp_size=tp), lay)
    state = hf.state_dict()
    assert set(state) - set(weights) == ({"lm_head.weight"} if lay.tied else set())
    assert all(torch.equal(weights[k], state[k]) for k in weights)


def test_the_aux_loss_coefficient_is_a_train_setting():
    from gyre.config import load
    from gyre.train.config import TrainConfig

    assert load(TrainConfig, {}, "train").moe_aux_loss_coeff == 0  # RL: the objective alone
    assert load(TrainConfig, {"moe_aux_loss_coeff": 0.01}, "train").moe_aux_loss_coeff == 0.01
    with pytest.raises(ConfigError, match=r"train\.moe_aux_loss_coeff: -1.0; allowed a number"):
        load(TrainConfig, {"moe_aux_loss_coeff": -1.0}, "train")


def test_a_positive_aux_loss_coefficient_trains_the_router_to_balance(megatron_world):
    """`train.moe_aux_loss_coeff` > 0 (through `MegatronConfig`): the same log-probs, and the
    load-balancing loss's gradient added in the backward (the router's and, through the
    hidden states, the attention's gradients change); 0 adds nothing."""
    import warnings

    from gyre.train.config import ObjectiveConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model

    hf = tiny_family("qwen3_moe")
    hfc = hf.config.to_dict()
    lay = WeightLayout.from_hf_config(hfc)
    step = _step(hf.config.vocab_size)
    runs = {}
    for coeff in (0.0, 0.1):
        shard = stage_to_mcore(dict(hf.state_dict()), lay, tp_rank=0, tp_size=1, stage=0,
                               stages=1)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_rank_model(hfc, shard, MegatronConfig(dtype="float32",
                                                                moe_aux_loss_coeff=coeff),
                                     device="cpu")  # fmt: skip
        cell = MegatronCell(model, objective=ObjectiveConfig())
        logp, st = cell._logprobs(step, grad=True)
        cell._backward((logp * st.targets).sum())
        runs[coeff] = logp.detach(), {n: cell.grad_of(p).clone()
                                      for n, p in model.named_parameters()}  # fmt: skip
    (logp0, g0), (logp1, g1) = runs[0.0], runs[0.1]
    assert torch.equal(logp0, logp1)
    router = "decoder.layers.1.mlp.router.weight"
    assert _rel(g1[router], g0[router]) > 1e-4
    embedding = "embedding.word_embeddings.weight"
    assert not torch.equal(g1[embedding], g0[embedding])
