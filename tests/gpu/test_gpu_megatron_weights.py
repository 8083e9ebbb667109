"""HF ↔ Megatron ↔ engine weight layouts: exact round trips, TP shards, Megatron's own split.

The pure layout tests run everywhere; the GPTModel tests build a real Megatron model on CPU
(its forward runs on CPU through gyre.train.megatron.cpu's patches) and need
megatron-core.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import TrainingError
from gyre.train.megatron.weights import (
    WeightLayout,
    fuse_qkv,
    hf_order,
    hf_to_mcore,
    mcore_to_hf,
    split_qkv,
    stage_layers,
    stage_to_mcore,
    stages_to_hf,
    tensor_state,
)


def _reference_fuse(q, k, v, heads, groups, hd):
    """Slow, obvious: walk the groups, append their query heads, then k, then v."""
    rows = []
    per = heads // groups
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * hd : (h + 1) * hd])
        rows.append(k[g * hd : (g + 1) * hd])
        rows.append(v[g * hd : (g + 1) * hd])
    return torch.cat(rows)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4]),
    per=st.sampled_from([1, 2, 3]),
    hd=st.sampled_from([2, 4]),
    bias=st.booleans(),
)
def test_fuse_qkv_matches_reference_and_inverts(groups, per, hd, bias):
    heads, hidden = groups * per, 8
    lay = WeightLayout(
        num_layers=1, heads=heads, groups=groups, head_dim=hd, qkv_bias=bias, tied=True
    )
    shape = () if bias else (hidden,)
    q = torch.randn(heads * hd, *shape)
    k, v = torch.randn(groups * hd, *shape), torch.randn(groups * hd, *shape)
    fused = fuse_qkv(q, k, v, lay)
    assert torch.equal(fused, _reference_fuse(q, k, v, heads, groups, hd))
    for a, b in zip(split_qkv(fused, lay), (q, k, v)):
        assert torch.equal(a, b)


def _hf_state(lay: WeightLayout, hidden=8, ffn=12, vocab=16):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": r(hidden)}
    if not lay.tied:
        sd["lm_head.weight"] = r(vocab, hidden)
    for i in range(lay.num_layers):
        h = f"model.layers.{i}"
        sd[f"{h}.input_layernorm.weight"] = r(hidden)
        sd[f"{h}.post_attention_layernorm.weight"] = r(hidden)
        for p, n in (("q", lay.heads), ("k", lay.groups), ("v", lay.groups)):
            sd[f"{h}.self_attn.{p}_proj.weight"] = r(n * lay.head_dim, hidden)
            if lay.qkv_bias:
                sd[f"{h}.self_attn.{p}_proj.bias"] = r(n * lay.head_dim)
        sd[f"{h}.self_attn.o_proj.weight"] = r(hidden, lay.heads * lay.head_dim)
        sd[f"{h}.mlp.gate_proj.weight"] = r(ffn, hidden)
        sd[f"{h}.mlp.up_proj.weight"] = r(ffn, hidden)
        sd[f"{h}.mlp.down_proj.weight"] = r(hidden, ffn)
    return sd


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_over_tp_shards_is_exact(tp, tied, fused_norms):
    lay = WeightLayout(num_layers=2, heads=8, groups=4, head_dim=2, qkv_bias=True, tied=tied,
                 fused_norms=fused_norms)  # fmt: skip
    hf = _hf_state(lay)
    shards = [hf_to_mcore(hf, lay, tp_rank=r, tp_size=tp) for r in range(tp)]
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((8 + 2 * 4) * 2 // tp, 8)  # whole query groups per rank
    back = mcore_to_hf(shards, lay)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_pipeline_stages_cover_the_model_once():
    lay = WeightLayout(num_layers=4, heads=2, groups=1, head_dim=4, qkv_bias=False, tied=False)
    hf = _hf_state(lay)
    first = hf_to_mcore(hf, lay, layers=[0, 1], last_stage=False)
    last = hf_to_mcore(hf, lay, layers=[2, 3], first_stage=False)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    back = {**mcore_to_hf([first], lay, layers=[0, 1], last_stage=False),
            **mcore_to_hf([last], lay, layers=[2, 3], first_stage=False)}  # fmt: skip
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (1, 4)])
@pytest.mark.parametrize("tied", [True, False])
def test_a_tp_by_pp_cell_round_trips_exactly(tp, pp, tied):
    """A cell's ranks in Gyre's order (rank s: TP rank s % TP of stage s // TP) gather back
    to the HF tensors; a tied embedding's last-stage copy is the embedding itself."""
    lay = WeightLayout(num_layers=4, heads=8, groups=4, head_dim=2, qkv_bias=True, tied=tied)
    hf = _hf_state(lay)
    ranks = [stage_to_mcore(hf, lay, tp_rank=s % tp, tp_size=tp, stage=s // tp, stages=pp)
             for s in range(tp * pp)]  # fmt: skip
    assert all(len([k for k in r if ".layers." in k and "linear_fc2" in k]) == 4 // pp
               for r in ranks)  # fmt: skip
    if tied:
        last = ranks[-1]["output_layer.weight"]
        assert torch.equal(last, ranks[tp - 1]["embedding.word_embeddings.weight"])
    back = stages_to_hf(ranks, lay, tp_size=tp)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(TrainingError, match="4 layers not divisible by pipeline 3"):
        stage_to_mcore(hf, lay, tp_rank=0, tp_size=1, stage=0, stages=3)


def _moe_state(lay: WeightLayout, hidden=8, ffn=12):
    """`_hf_state` with each layer's MLP replaced by a router and `lay.experts` experts."""
    g = torch.Generator().manual_seed(1)
    sd = {k: v for k, v in _hf_state(lay, hidden=hidden).items() if ".mlp." not in k}
    for i in range(lay.num_layers):
        h = f"model.layers.{i}.mlp"
        sd[f"{h}.gate.weight"] = torch.randn(lay.experts, hidden, generator=g)
        for j in range(lay.experts):
            for p, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)),
                             ("down", (hidden, ffn))):  # fmt: skip
                sd[f"{h}.experts.{j}.{p}_proj.weight"] = torch.randn(*shape, generator=g)
    return sd


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 2), (4, 2, 2), (4, 1, 4), (4, 2, 1)])
def test_experts_split_over_expert_parallel_blocks_and_round_trip(tp, pp, ep):
    """TP rank t of a stage holds the experts of block t // ETP (ETP = TP / EP) as
    local_experts 0.., each cut to its ETP rank t % ETP's rows (slow reference below); every
    rank of the cell gathers back to the HF tensors exactly."""
    lay = WeightLayout(num_layers=2, heads=8, groups=4, head_dim=2, qkv_bias=False, tied=False,
                       experts=4, expert_parallel=ep)  # fmt: skip
    hf = _moe_state(lay)
    ranks = [stage_to_mcore(hf, lay, tp_rank=s % tp, tp_size=tp, stage=s // tp, stages=pp)
             for s in range(tp * pp)]  # fmt: skip
    etp, per = tp // ep, 4 // ep
    for s, shard in enumerate(ranks):
        t, stage = s % tp, s // tp
        experts = [k for k in shard if k.endswith("linear_fc2.weight") and "local_experts" in k]
        assert len(experts) == per * 2 // pp
        for local in range(2 // pp):
            for k in range(per):
                j, i = (t // etp) * per + k, stage * (2 // pp) + local
                down = hf[f"model.layers.{i}.mlp.experts.{j}.down_proj.weight"]
                d = f"decoder.layers.{local}.mlp.experts.local_experts.{k}"
                cut = slice((t % etp) * 12 // etp, (t % etp + 1) * 12 // etp)
                assert torch.equal(shard[f"{d}.linear_fc2.weight"], down[:, cut])
    back = stages_to_hf(ranks, lay, tp_size=tp)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_bad_input_is_named():
    lay = WeightLayout(num_layers=1, heads=4, groups=2, head_dim=2, qkv_bias=False, tied=True)
    hf = _hf_state(lay)
    with pytest.raises(TrainingError, match="not divisible by TP 4"):
        hf_to_mcore(hf, lay, tp_rank=0, tp_size=4)
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(TrainingError, match=r"up_proj\.weight' missing"):
        hf_to_mcore(hf, lay)


def _whole_then_split(hf, lay, *, tp_rank, tp_size, stage, stages):
    """Slow and obvious, as `stage_to_mcore` did it before ranks read slices: fuse the whole
    q/k/v (`_reference_fuse`), then cut every tensor, the fused one included, into TP chunks."""
    cut = lambda t, dim: t.chunk(tp_size, dim=dim)[tp_rank].clone()  # noqa: E731
    per, emb = lay.num_layers // stages, hf["model.embed_tokens.weight"]
    out = {"embedding.word_embeddings.weight": cut(emb, 0)} if stage == 0 else {}
    for local, i in enumerate(range(stage * per, (stage + 1) * per)):
        h, d = f"model.layers.{i}", f"decoder.layers.{local}"
        out[f"{d}.input_layernorm.weight"] = hf[f"{h}.input_layernorm.weight"].clone()
        out[f"{d}.pre_mlp_layernorm.weight"] = hf[f"{h}.post_attention_layernorm.weight"].clone()
        for kind in ("weight", "bias") if lay.qkv_bias else ("weight",):
            q, k, v = (hf[f"{h}.self_attn.{p}_proj.{kind}"] for p in "qkv")
            fused = _reference_fuse(q, k, v, lay.heads, lay.groups, lay.head_dim)
            out[f"{d}.self_attention.linear_qkv.{kind}"] = cut(fused, 0)
        out[f"{d}.self_attention.linear_proj.weight"] = cut(hf[f"{h}.self_attn.o_proj.weight"], 1)
        out[f"{d}.mlp.linear_fc1.weight"] = torch.cat(
            [cut(hf[f"{h}.mlp.gate_proj.weight"], 0), cut(hf[f"{h}.mlp.up_proj.weight"], 0)]
        )
        out[f"{d}.mlp.linear_fc2.weight"] = cut(hf[f"{h}.mlp.down_proj.weight"], 1)
    if stage == stages - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not lay.tied:
            out["output_layer.weight"] = cut(hf["lm_head.weight"], 0)
        elif stage > 0:
            out["output_layer.weight"] = cut(emb, 0)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Small random Qwen2 models saved by `save_pretrained` (safetensors): tied or not, one
    file or sharded (with model.safetensors.index.json), float32 or bfloat16; with their
    state dicts."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = {}
    for tied in (True, False):
        for sharded in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=4, tie_word_embeddings=tied)  # fmt: skip
                model = Qwen2ForCausalLM(config).to(dtype)
                folder = tmp_path_factory.mktemp("qwen2")
                model.save_pretrained(folder, max_shard_size="20KB" if sharded else "1GB")
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                out[tied, sharded, dtype] = folder, state, config.to_dict()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_a_rank_reads_exactly_its_slice_of_the_files(saved_models, tied, sharded, dtype):
    """Each rank of TP 1, 2, 4 x PP 1, 2 reads only its chunks of its stage's tensors from
    the safetensors files, and gets byte for byte what the whole-model path computes: the
    whole tensors fused then split (`_whole_then_split`), and `stage_to_mcore` of the full
    state dict."""
    from gyre.train.megatron.shard_files import SafetensorsFiles

    folder, state, config = saved_models[tied, sharded, dtype]
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    lay = WeightLayout.from_hf_config(config)
    files = SafetensorsFiles.find(str(folder))
    reads = []
    chunk = files.chunk
    files.chunk = lambda name, dim, rank, size: (reads.append((name, size)),
                                                 chunk(name, dim, rank, size))[1]  # fmt: skip
    for tp in (1, 2, 4):
        for pp in (1, 2):
            for s in range(tp * pp):
                kw = {"tp_rank": s % tp, "tp_size": tp, "stage": s // tp, "stages": pp}
                reads.clear()
                ours = stage_to_mcore(files, lay, **kw)
                for want in (_whole_then_split(state, lay, **kw), stage_to_mcore(state, lay, **kw)):
                    assert list(ours) == list(want)
                    for k, t in ours.items():
                        assert t.dtype == want[k].dtype == dtype and t.is_contiguous(), k
                        assert _bytes(t) == _bytes(want[k]), k
                # only this stage's layers; only the replicated norms whole
                layers = {int(n.split(".")[2]) for n, _ in reads if n.startswith("model.layers.")}
                assert layers == set(stage_layers(lay, s // tp, pp))
                assert {n for n, size in reads if size != tp} <= {n for n in state if "norm" in n}


def test_a_directory_without_safetensors_is_not_a_source(tmp_path):
    from gyre.train.megatron.shard_files import SafetensorsFiles

    assert SafetensorsFiles.find("tiny") is None
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert SafetensorsFiles.find(str(tmp_path)) is None
    with pytest.raises(TrainingError, match=r"no model\.safetensors nor"):
        SafetensorsFiles(tmp_path)


def test_a_missing_tensor_names_the_files(saved_models):
    from gyre.train.megatron.shard_files import SafetensorsFiles

    folder, _, config = saved_models[True, True, torch.float32]
    lay = WeightLayout.from_hf_config({**config, "tie_word_embeddings": False})
    with pytest.raises(TrainingError, match=r"'lm_head.weight' missing in the safetensors"):
        stage_to_mcore(SafetensorsFiles(folder), lay, tp_rank=0, tp_size=1, stage=0, stages=1)


def test_gpt_model_from_tiny_config_matches_hf_layers(megatron_world):
    from gyre.models import load_model
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import build_gpt_model

    hf_model, _ = load_model("tiny")
    hfc = hf_model.config.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt_model(hfc, MegatronConfig(dtype="float32"), device="cpu")
    lay = WeightLayout.from_hf_config(hfc)
    mc = hf_to_mcore(hf_model.state_dict(), lay)
    assert {k: tuple(v.shape) for k, v in mc.items()} == {
        k: tuple(v.shape) for k, v in tensor_state(model).items()
    }
    result = model.load_state_dict(mc, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    # Megatron's own code splits the fused tensors exactly as HF computes them
    x = torch.randn(5, 2, hfc["hidden_size"])
    for i, layer in enumerate(hf_model.model.layers):
        att = model.decoder.layers[i].self_attention
        q, k, v = att.get_query_key_value_tensors(x)[:3]
        for ours, proj in ((q, layer.self_attn.q_proj), (k, layer.self_attn.k_proj),
                           (v, layer.self_attn.v_proj)):  # fmt: skip
            assert torch.allclose(ours.reshape(5, 2, -1), proj(x), atol=1e-6)
        mlp = model.decoder.layers[i].mlp(x)
        mlp = mlp[0] if isinstance(mlp, tuple) else mlp
        assert torch.allclose(mlp, layer.mlp(x), atol=1e-6)
    # the whole forward (on CPU through gyre.train.megatron.cpu) gives transformers' logits
    ids = torch.randint(0, hfc["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    width = ids.shape[1]
    positions = torch.arange(width).expand(2, width)
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(ids, positions, causal)
        assert torch.allclose(logits, hf_model(input_ids=ids).logits, atol=2e-5)
    # and the export gives the engine exactly the HF tensors back
    back = mcore_to_hf([tensor_state(model)], lay)
    for name, t in hf_model.state_dict().items():
        if name in back:
            assert torch.equal(back[name], t), name
    assert set(hf_model.state_dict()) - set(back) <= {"lm_head.weight"}  # tied


@pytest.mark.parametrize("tied", [True, False])
def test_an_uninitialized_build_marks_the_sharded_weights_as_megatron_does(megatron_world, tied):
    """`build_gpt_model` skips Megatron's weight initialization, which is where its local layers
    set the tensor-parallel attributes: every parameter carries the same
    `tensor_model_parallel`, `partition_dim` and `partition_stride` as in a GPTModel built
    with `perform_initialization=True` (without them the clip norm counted a sharded weight
    on TP rank 0 only: the TP 2 gradient norm 26 % low)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gyre.train.megatron.attention import layer_spec
    from gyre.train.megatron.config import MegatronConfig, gpt_kwargs, transformer_kwargs
    from gyre.train.megatron.model import build_gpt_model

    hfc = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
           "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
           "vocab_size": 64, "tie_word_embeddings": tied}  # fmt: skip
    cfg = MegatronConfig(dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = build_gpt_model(hfc, cfg, device="cpu")
        tc = TransformerConfig(**transformer_kwargs(hfc, cfg), activation_func=torch.nn.functional.silu,
                               use_cpu_initialization=True, perform_initialization=True)  # fmt: skip
        initialized = GPTModel(tc, layer_spec("sdpa"), pre_process=True, post_process=True,
                               **gpt_kwargs(hfc))  # fmt: skip
    assert parallel_state.get_tensor_model_parallel_world_size() == 1

    def marks(model):
        keys = ("tensor_model_parallel", "partition_dim", "partition_stride")
        return {n: tuple(getattr(p, k, None) for k in keys) for n, p in model.named_parameters()}

    assert marks(ours) == marks(initialized)
    assert marks(ours)["decoder.layers.0.mlp.linear_fc1.weight"] == (True, 0, 2)


def test_megatron_cell_and_optimizer_on_cpu(megatron_world):
    """The cell re-homes GPTModel parameters into flat buffers; the model-parallel optimizer
    (group of one here) clips by the global norm and steps like the torch core optimizer."""
    from gyre.train.cell import CoreOptimizer, TorchCell
    from gyre.train.config import ObjectiveConfig, OptimConfig
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, ModelParallelOptimizer, build_gpt_model

    hfc = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
           "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
           "vocab_size": 64, "tie_word_embeddings": True}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt_model(hfc, MegatronConfig(dtype="float32"), device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # built uninitialized: weights of our own
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    cell = MegatronCell(model, objective=ObjectiveConfig())
    assert cell.flat_params.numel() == sum(p.numel() for p in model.parameters())
    twin = TorchCell(torch.nn.Linear(1, cell.flat_params.numel(), bias=False),
                     objective=ObjectiveConfig())  # fmt: skip
    twin.flat_params.copy_(cell.flat_params)
    grads = torch.randn_like(cell.flat_params) * 10  # norm >> 1: clipping applies
    cfg = OptimConfig(lr=1e-2)
    norm = ModelParallelOptimizer(cell, cfg).step(grads)
    ref = CoreOptimizer(twin, cfg).step(grads)
    assert norm == pytest.approx(ref, rel=1e-6) and norm > 1
    assert torch.allclose(cell.flat_params, twin.flat_params, atol=1e-7)


@pytest.mark.parametrize("kind", ["qwen2-tied", "qwen2", "qwen3_moe"])
def test_the_hf_order_comes_from_a_skeleton_without_weights(kind):
    """The HF flat order (what a checkpoint's `hf_order` and `hf_flat` use) is the real
    model's `named_parameters()` order — tied weights once, a MoE layer's experts stacked as
    its modules hold them — from the config alone: nothing is allocated."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4,
                                                   num_experts_per_tok=2, **small))  # fmt: skip
    else:
        model = Qwen2ForCausalLM(Qwen2Config(intermediate_size=48,
                                             tie_word_embeddings=kind == "qwen2-tied", **small))  # fmt: skip
    real = [n for n, p in model.named_parameters() if p.requires_grad]
    assert hf_order(model.config.to_dict()) == real
    assert ("lm_head.weight" in real) == (kind != "qwen2-tied")
