"""The memory plan (`gyre.train.memory`, issue 51 item 7): each rank's bytes, checked against
slow, obvious references, its properties, its refusal and its command line.

* parameters per rank: every tensor `gyre.train.megatron.weights` cuts for a TP rank of a
  pipeline stage (on the meta device: shapes only), summed — and the Hugging Face model's own
  count for the torch backend;
* activations per layer: the bytes autograd saves in a real forward (a saved-tensors hook
  over a tiny model, parameters excluded), for the torch backend's HF model here and for
  Megatron's layer in a subprocess (its gloo world of one);
* properties (hypothesis): more row, more bytes; TP halves the sharded weights; bf16 halves
  the weights and adds float32 main weights; only stepping ranks hold moments; `local`
  attention is never below `sdpa` and grows with the square of the row;
* the refusal names the rank, its parts and what would fit, through the preflight and
  `gyre plan --memory` (exit 1 when it does not fit, 2 on bad input).

Predicted vs measured peaks of real micro-steps: tools/bench_memory_plan.py, docs/gpu.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.cli import main
from gyre.errors import ConfigError
from gyre.schedule.pipeline import one_f_one_b
from gyre.train import memory
from gyre.train.memory import (
    GB,
    MemoryPlan,
    ModelShape,
    TrainLayout,
    layer_activation_bytes,
    plan_engine,
    plan_ranks,
    rank_parameters,
)

ROOT = Path(__file__).resolve().parents[2]


def hf(**over: object) -> dict[str, object]:
    """A small Qwen2 config.json (every width distinct, so a swapped term shows)."""
    base = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 192,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_hidden_layers": 4, "vocab_size": 256, "tie_word_embeddings": True,
            "max_position_embeddings": 4096}  # fmt: skip
    return {**base, **over}


QWEN2_7B = hf(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
              num_key_value_heads=4, head_dim=128, num_hidden_layers=28, vocab_size=152064,
              tie_word_embeddings=False)  # fmt: skip
QWEN3 = hf(model_type="qwen3")
QWEN3_MOE = hf(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=48, norm_topk_prob=True)  # fmt: skip
QWEN2_MOE = hf(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=48, shared_expert_intermediate_size=80)  # fmt: skip
FAMILIES = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE}
"""Beside Qwen2 / Llama: q/k norms, routed experts, and a gated shared expert."""
LLAMA_70B = hf(model_type="llama", hidden_size=8192, intermediate_size=28672,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128,
               num_hidden_layers=80, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip


def _meta_state(config: dict[str, object]) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return dict(model.state_dict())


@pytest.mark.parametrize(("config", "tp", "pp"), [
    (config, tp, pp)
    for config in (hf(), hf(tie_word_embeddings=False), hf(model_type="llama", num_key_value_heads=4),
                   *FAMILIES.values())
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 4))
    if int(config["num_key_value_heads"]) % tp == 0  # type: ignore[call-overload]
])  # fmt: skip
def test_rank_parameters_are_what_the_weight_loader_cuts(config: dict, tp: int, pp: int) -> None:
    """Reference: every tensor `stage_to_mcore` gives a TP rank of a stage, summed."""
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore

    state = _meta_state(config)
    layout = WeightLayout.from_hf_config(config)
    shape = ModelShape.from_hf(config)
    for stage in range(pp):
        for rank in range(tp):
            cut = stage_to_mcore(state, layout, tp_rank=rank, tp_size=tp, stage=stage, stages=pp)
            assert rank_parameters(shape, tp, pp, stage) == sum(t.numel() for t in cut.values())
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert shape.parameters == sum(p.numel() for p in whole.parameters())


def saved_bytes(model: torch.nn.Module, run: object) -> int:
    """Bytes of the distinct storages autograd saves while `run()` goes forward, the
    model's parameters excluded (the slow, obvious count of activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()  # type: ignore[operator]
    return sum(seen.values())


def _predicted_saved(config: dict, layout: TrainLayout, tokens: int) -> int:
    shape = ModelShape.from_hf(config)
    return (shape.layers * layer_activation_bytes(shape, layout, tokens)
            + memory.outer_activation_bytes(shape, layout, tokens))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("change", [{}, {"intermediate_size": 384}, {"hidden_size": 128},
                                    {"num_key_value_heads": 4}, {"num_attention_heads": 8},
                                    {"num_hidden_layers": 2}, {"head_dim": 32}, QWEN3, QWEN3_MOE,
                                    {**QWEN3_MOE, "num_experts_per_tok": 4},
                                    {**QWEN3_MOE, "moe_intermediate_size": 96}, QWEN2_MOE,
                                    {**QWEN2_MOE, "shared_expert_intermediate_size": 160}],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()
                                                if hf().get(k) != v) or "qwen2")  # fmt: skip
def test_torch_backend_activations_are_what_autograd_saves(dtype: str, change: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = hf(**change)
    cfg = AutoConfig.for_model(**config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).train()
    tokens = 192
    ids = torch.randint(0, 256, (1, tokens))
    counted = saved_bytes(model, lambda: model(input_ids=ids).logits)
    predicted = _predicted_saved(config, TrainLayout(dtype=dtype), tokens)  # type: ignore[arg-type]
    assert predicted == pytest.approx(counted, rel=0.03), (predicted, counted)


MEGATRON_CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from gyre.train.megatron.config import MegatronConfig
from gyre.train.megatron.model import build_gpt_model, init_model_parallel
sys.path.insert(0, sys.argv[1])
from test_memory_plan import saved_bytes
dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
out = []
for config, dtype, attention, tokens in json.loads(sys.argv[3]):
    cfg = MegatronConfig(dtype=dtype, attention=attention)
    init_model_parallel(cfg, "cpu")
    model = build_gpt_model(config, cfg, device="cpu").train()
    for p in model.parameters():
        torch.nn.init.normal_(p.data, std=0.02)
    ids, pos = torch.randint(0, 256, (1, tokens)), torch.arange(tokens)[None]
    mask = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)[None, None] if attention == "local" else None
    out.append(saved_bytes(model, lambda: model(ids, pos, mask)))
print(json.dumps(out))
"""


def test_megatron_activations_are_what_autograd_saves(tmp_path: Path) -> None:
    """Megatron's layer (TP 1, in a subprocess: its own gloo world), sdpa and local."""
    pytest.importorskip("megatron.core")
    from processes import rendezvous

    cases = [(hf(**c), d, a, 128) for c in ({}, {"intermediate_size": 384},
                                            {"hidden_size": 128}, {"num_attention_heads": 8},
                                            {"head_dim": 32}, *FAMILIES.values())
             for d in ("float32", "bfloat16") for a in ("sdpa", "local")]  # fmt: skip
    cases += [({**QWEN3_MOE, **c}, d, "sdpa", 128) for d in ("float32", "bfloat16")
              for c in ({"num_experts_per_tok": 4}, {"moe_intermediate_size": 96})]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MEGATRON_CHILD, str(Path(__file__).parent),
                           rendezvous(tmp_path), json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = json.loads(proc.stdout.strip().splitlines()[-1])
    for (config, dtype, attention, tokens), got in zip(cases, counted, strict=True):
        layout = TrainLayout(backend="megatron", dtype=dtype, attention=attention,
                             row_tokens=tokens, token_budget=tokens)  # fmt: skip
        shape = ModelShape.from_hf(config)
        scores, _ = memory.attention_scores_bytes(shape, layout)
        predicted = _predicted_saved(config, layout, tokens) + shape.layers * scores
        assert predicted == pytest.approx(got, rel=0.05), (config, dtype, attention)


def test_chunk_elements_are_the_objectives() -> None:
    from gyre.train.objective import CHUNK_ELEMENTS

    assert memory.CHUNK_ELEMENTS == CHUNK_ELEMENTS


# ---- properties ------------------------------------------------------------------------
layouts = st.builds(
    TrainLayout,
    backend=st.sampled_from(["torch", "megatron"]),
    tensor=st.sampled_from([1, 2, 4]),
    pipeline=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    attention=st.sampled_from(["sdpa", "local"]),
    row_tokens=st.integers(1, 1 << 17),
    token_budget=st.integers(1, 1 << 17),
)
shapes = st.sampled_from([ModelShape.from_hf(c) for c in (hf(), QWEN2_7B, LLAMA_70B)])


def _megatron(layout: TrainLayout) -> TrainLayout:
    return replace(layout, backend="megatron") if layout.backend == "megatron" else replace(
        layout, tensor=1, pipeline=1)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(shapes, layouts, st.integers(1, 1 << 16))
def test_more_row_never_needs_less(shape: ModelShape, layout: TrainLayout, more: int) -> None:
    layout = _megatron(layout)
    longer = replace(layout, row_tokens=layout.row_tokens + more)
    for a, b in zip(plan_ranks(shape, layout), plan_ranks(shape, longer), strict=True):
        assert b.peak >= a.peak


@settings(max_examples=100, deadline=None)
@given(shapes, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_tensor_parallel_halves_the_sharded_weights(shape: ModelShape, tp: int, pp: int) -> None:
    replicated = 2 * shape.hidden * shape.layers // pp + shape.hidden  # norms, last stage
    for stage in range(pp):
        one, two = rank_parameters(shape, tp, pp, stage), rank_parameters(shape, 2 * tp, pp, stage)
        norms = replicated if stage == pp - 1 else replicated - shape.hidden
        assert two - norms == pytest.approx((one - norms) / 2, rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(shapes, layouts)
def test_bf16_halves_weights_and_adds_main_weights_on_stepping_ranks(
    shape: ModelShape, layout: TrainLayout
) -> None:
    layout = _megatron(layout)
    fp32 = plan_ranks(shape, replace(layout, dtype="float32"))
    bf16 = plan_ranks(shape, replace(layout, dtype="bfloat16"))
    for a, b in zip(fp32, bf16, strict=True):
        assert 2 * b.parts["weights"] == a.parts["weights"]
        assert b.parts["gradients"] == a.parts["gradients"]  # float32 accumulation in both
        steps = layout.backend == "megatron" or a.shard == 0  # every_core_rank_steps
        assert ("moments" in a.parts) == steps and a.parts.get("main", 0) == 0
        assert b.parts.get("main", 0) == (4 * b.parameters if steps else 0)


@settings(max_examples=100, deadline=None)
@given(shapes, layouts)
def test_sequence_parallelism_divides_the_replicated_activations_by_tp(
    shape: ModelShape, layout: TrainLayout
) -> None:
    """Under sequence parallelism a layer's `h` terms (norms, residual, the input a
    column-parallel layer saves) and the embedding's output are this rank's slice of the
    sequence: what the two layouts differ by is the replicated part's (TP - 1) / TP; no
    change at TP 1, and the weights do not move."""
    layout = replace(layout, backend="megatron")
    off, on = replace(layout, sequence=False), replace(layout, sequence=True)
    tokens, tp, b = layout.step_tokens, layout.tensor, memory.dtype_bytes(layout.dtype)
    h = shape.hidden
    rep = tokens * (6 * b * h + (8 * h if b == 2 else 0))
    saved = memory.layer_activation_bytes(shape, off, tokens)
    assert saved - memory.layer_activation_bytes(shape, on, tokens) == pytest.approx(
        rep - rep / tp, abs=tokens)  # fmt: skip
    outer = memory.outer_activation_bytes(shape, off, tokens)
    assert memory.outer_activation_bytes(shape, on, tokens) == outer // tp
    for a, c in zip(plan_ranks(shape, off), plan_ranks(shape, on), strict=True):
        assert c.resident == a.resident
        assert c.parts["micro-step"] <= a.parts["micro-step"]
        assert (c.parts["micro-step"] == a.parts["micro-step"]) == (tp == 1)


@settings(max_examples=100, deadline=None)
@given(shapes, layouts)
def test_local_attention_is_never_below_sdpa_and_grows_with_the_square(
    shape: ModelShape, layout: TrainLayout
) -> None:
    layout = replace(layout, backend="megatron", token_budget=1, row_tokens=layout.row_tokens)
    local, sdpa = (replace(layout, attention=a) for a in ("local", "sdpa"))
    extra = memory.micro_step_bytes(shape, local) - memory.micro_step_bytes(shape, sdpa)
    assert extra >= 0
    doubled = replace(local, row_tokens=2 * local.row_tokens)
    saved, _ = memory.attention_scores_bytes(shape, doubled)
    assert saved == 4 * memory.attention_scores_bytes(shape, local)[0]


def test_the_torch_backend_steps_on_the_leader_only_and_megatron_on_its_first_replica() -> None:
    from gyre.train.backends import BACKENDS
    from gyre.train.config import ParallelDims

    shape = ModelShape.from_hf(hf())
    for name, b in BACKENDS.items():
        for data in (1, 2):
            tensor = 2 if name == "megatron" else 1
            layout = TrainLayout(backend=name, tensor=tensor, data=data)  # type: ignore[arg-type]
            dims = ParallelDims(tensor=tensor, pipeline=1, data=data)
            ranks = plan_ranks(shape, layout)
            owns = [b.owns_optimizer(r.shard, dims) for r in ranks]
            assert [("moments" in r.parts) for r in ranks] == owns
            assert sum(owns) == (tensor if name == "megatron" else 1)


def test_engine_kv_pool_is_what_is_left_of_the_static_share() -> None:
    shape = ModelShape.from_hf(QWEN2_7B)
    e = plan_engine(shape, tensor_parallel=2, mem_fraction_static=0.8, gpu_bytes=int(80 * GB))
    assert e.static == 64 * GB and e.weights == shape.parameters  # bf16 over 2 GPUs
    per_token = sum(2 * (4 // 2) * 128 * 2 for _ in range(28))  # K and V, each layer
    assert e.kv_bytes_per_token == per_token
    assert e.kv_tokens == (e.static - e.weights) // per_token


# ---- the refusal, the preflight, the command line ---------------------------------------
def test_a_70b_on_one_gpu_is_refused_with_its_numbers_and_what_fits() -> None:
    plan = MemoryPlan(shape=ModelShape.from_hf(LLAMA_70B),
                      layout=TrainLayout(backend="megatron", tensor=8, dtype="bfloat16",
                                         row_tokens=16384, token_budget=16384),
                      gpu=True, limit=int(80 * GB))  # fmt: skip
    problem = plan.rank_problem()
    assert problem is not None and problem.startswith("rank 0 needs ")
    for part in (
        "> 80.0 GB",
        "weights 17.",
        "main 35.",
        "gradients 35.",
        "moments 70.",
        "micro-step",
        "update",
        "CUDA runtime",
        "fits with train.parallel tensor ",
    ):
        assert part in problem, problem
    for layout in memory.layouts_that_fit(
        plan.shape, plan.layout, int(80 * GB) - memory.GPU_RUNTIME_BYTES
    ):
        assert f"tensor {layout.tensor} x pipeline {layout.pipeline}" in problem
        assert replace(plan, layout=layout).rank_problem() is None
    smaller = replace(plan.layout, pipeline=2)  # fewer ranks than the fewest that fit
    assert replace(plan, layout=smaller).rank_problem() is not None


def _config(tmp_path: Path, **sections: object) -> Path:
    import yaml

    path = tmp_path / "run.yaml"
    data = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    for key, value in sections.items():
        data.setdefault(key, {}).update(value) if isinstance(value, dict) else data.update(
            {key: value})  # fmt: skip
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_preflight_refuses_a_gpu_layout_that_cannot_fit(tmp_path: Path) -> None:
    from gyre.runtime.preflight import Where, preflight
    from gyre.runtime.shared.config import load_run_config

    path = _config(tmp_path, train={"device": "cuda"}, topology={"gpu_memory_gb": 1.6})
    cfg = load_run_config(path)
    with pytest.raises(ConfigError, match=r"^memory: rank 0 needs [\d.]+ GB > 1\.60 GB: "
                       r"weights .*; fits with train.backend megatron with train.parallel "
                       r"tensor 2"):  # fmt: skip
        preflight(cfg, Where.ANYWHERE)
    ok = load_run_config(path, ["topology.gpu_memory_gb=80"])
    preflight(ok, Where.ANYWHERE)
    cpu = load_run_config(path, ["train.device=cpu"])  # no CPU limit: printed, not enforced
    preflight(cpu, Where.ANYWHERE)
    with pytest.raises(ConfigError, match=r"^memory: rank 0 needs"):
        preflight(load_run_config(path, ["train.device=cpu", "topology.cpu_memory_gb=0.01"]),
                  Where.ANYWHERE)  # fmt: skip


def test_gyre_plan_memory_prints_the_plan_and_exits_1_when_it_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path)
    assert main(["plan", "--memory", str(path)]) == 0
    out = capsys.readouterr().out
    assert "limit per CPU rank: no limit set: not enforced; fits" in out
    assert "weights" in out and "micro-step" in out
    assert main(["plan", "--memory", str(path), "topology.cpu_memory_gb=0.01", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["fits"] and report["problem"].startswith("rank 0 needs")
    assert report["ranks"][0]["peak"] == sum(report["ranks"][0][k] for k in
                                             ("weights", "gradients", "moments", "main")) + max(
        report["ranks"][0]["micro-step"], report["ranks"][0]["update"])  # fmt: skip


@pytest.mark.parametrize("argv", [
    ["plan", "--memory", "/nonexistent/run.yaml"],
    ["plan", "--memory", "{cfg}", "train.no_such_key=1"],
    ["plan", "--memory", "{cfg}", "topology.gpu_memory_gb=-1"],
    ["plan", "--memory", "{cfg}", "model=/nonexistent-model"],
    ["plan", "--staleness", "1", "train.lr=1"],
    ["plan", "--staleness", "1", "--memory", "{cfg}"],
    ["plan"],
])  # fmt: skip
def test_gyre_plan_memory_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    path = _config(tmp_path)
    argv = [a.replace("{cfg}", str(path)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err


# ---- a window of micro-steps through the pipeline stages -------------------------------
def live_forwards(stage: int, stages: int, microsteps: int) -> int:
    """The reference: walk the stage's 1F1B order (what the Megatron cell runs) and count the
    forwards whose backward has not run yet; the most at any point."""
    live = most = 0
    for kind, _ in one_f_one_b(stage, stages, microsteps):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.integers(1, 40))
def test_the_micro_steps_in_flight_are_the_1f1b_orders(stages: int, window: int) -> None:
    layout = TrainLayout(backend="megatron", pipeline=stages, window=window)
    for s in range(stages):
        assert layout.in_flight(s) == live_forwards(s, stages, window) == min(window, stages - s)


def test_a_windows_activations_count_once_a_micro_step_in_flight() -> None:
    """Stage s's micro-step part grows with the window by one micro-step's activations per
    micro-step it holds at once, and by the hidden states its sends hold until the window
    ends (outputs on all but the last stage, input gradients on all but the first); without
    a pipeline the window changes nothing."""
    shape = ModelShape.from_hf(QWEN2_7B)
    base = TrainLayout(backend="megatron", tensor=4, pipeline=4, dtype="bfloat16", sequence=True,
                       row_tokens=16384, token_budget=16384)  # fmt: skip
    tokens, hidden = base.step_tokens, 16384 * 2 * shape.hidden // 4
    one_step = shape.layers // 4 * layer_activation_bytes(shape, base, tokens)
    one_step += memory.outer_activation_bytes(shape, base, tokens)
    alone = [memory.micro_step_bytes(shape, base, s) for s in range(4)]
    for window in range(1, 11):
        lay = replace(base, window=window)
        for s in range(4):
            sends = (s < 3) + (s > 0)
            grown = (lay.in_flight(s) - 1) * one_step + (window - 1) * sends * hidden
            assert memory.micro_step_bytes(shape, lay, s) - alone[s] == grown
    stage0 = [plan_ranks(shape, replace(base, window=w))[0].parts["micro-step"] for w in (1, 2, 4)]
    assert stage0[0] < stage0[1] < stage0[2]
    flat = replace(base, pipeline=1)
    assert plan_ranks(shape, replace(flat, window=8)) == plan_ranks(shape, flat)


def test_a_window_that_cannot_fit_is_refused_with_the_window_that_would() -> None:
    shape = ModelShape.from_hf(QWEN2_7B)
    lay = TrainLayout(backend="megatron", tensor=4, pipeline=4, dtype="bfloat16", sequence=True,
                      row_tokens=16384, token_budget=16384, window=8)  # fmt: skip
    at_two = max(r.peak for r in plan_ranks(shape, replace(lay, window=2)))
    plan = MemoryPlan(shape=shape, layout=lay, gpu=True,
                      limit=at_two + memory.GPU_RUNTIME_BYTES + 1)  # fmt: skip
    problem = plan.rank_problem()
    assert problem is not None and "schedule.window 2" in problem, problem
    assert replace(plan, layout=replace(lay, window=2)).rank_problem() is None


def test_gyre_plan_memory_shows_the_window_and_what_each_stage_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path)
    pp2 = ["train.backend=megatron", "topology.ranks_per_cell=2", "train.parallel.pipeline=2"]
    assert main(["plan", "--memory", str(path), *pp2]) == 0
    assert (
        "window 4 (schedule.window), 1F1B: micro-steps in flight by stage, "
        "min(window, 2 - stage): 2 on stage 0, 1 on stage 1"
    ) in capsys.readouterr().out
    assert main(["plan", "--memory", str(path), *pp2, "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["window"] == 4 and [r["in_flight"] for r in auto["ranks"]] == [2, 1]
    assert main(["plan", "--memory", str(path), *pp2, "schedule.window=1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["window"] == 1 and [r["in_flight"] for r in one["ranks"]] == [1, 1]
    assert one["ranks"][0]["micro-step"] < auto["ranks"][0]["micro-step"]
    assert main(["plan", "--memory", str(path)]) == 0  # no pipeline: one in flight, as before
    assert "window 1 (schedule.window): one micro-step in flight" in capsys.readouterr().out
