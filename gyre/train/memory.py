"""The memory plan: each training rank's bytes and its engine's, predicted from shapes alone.

Pure functions, no I/O, no torch: `gyre plan --memory CONFIG`, the preflight's memory check
(`gyre.runtime.shared.memory`) and `tools/bench_memory_plan.py` (predicted vs measured on
CPU) all ask this module, so the number an operator reads is the number the check enforces
and the bench measures.

    shape = ModelShape.from_hf(hf_config)                 # a config.json as a dict
    layout = TrainLayout(backend="megatron", tensor=4, pipeline=2, dtype="bfloat16",
                         row_tokens=16384, token_budget=16384)
    ranks = plan_ranks(shape, layout)                     # one RankMemory per cell rank
    ranks[0].peak, ranks[0].parts                         # bytes; what makes them up

What a training rank holds (docs/gpu.md "Memory plan"), in bytes, P its parameter count
(`rank_parameters`: the whole model for the torch backend, its TP shard of its pipeline stage
for Megatron's, as `gyre.train.megatron.weights` cuts them), b the parameters' bytes (4 for
float32, 2 for bfloat16):

* weights P·b; gradients P·4 (`flat_grads`: float32 under bfloat16, `main_dtype`);
* on ranks that step (`TrainBackend.owns_optimizer`: the core's leader for torch, every core
  rank of its first data-parallel replica for Megatron): AdamW's two float32 moments 8·P, and under bfloat16 the float32 main
  weights 4·P (`CoreOptimizer`);
* the micro-step: the activations autograd saves, per layer and token (counted from the
  tensors autograd saves in a real forward, `tests/train/test_memory_plan.py`), the row's
  attention (`sdpa`: a log-sum-exp per head, linear in the row; `local`: the probabilities,
  rows x heads x len x len per layer, plus the scores buffer, the mask and two gradients),
  then the last stage's logits and their gradient (tokens x vocabulary / TP, b each) and one
  float32 chunk of the chunked log-probs (`gyre.train.objective.CHUNK_ELEMENTS`); a pass's
  window of m micro-steps (`schedule.window`) runs 1F1B through P pipeline stages, so stage s
  holds the activations of min(m, P - s) of them at once (`TrainLayout.in_flight`), and the
  hidden states and input gradients its sends hold until the window ends;
* the update: the batch gradient summed, scaled by 1/E and copied (three float32 copies of
  P), and AdamW's two float32 temporaries (its denominator): 20·P above the resident state.

A rank's peak is its resident state plus the larger of the micro-step and the update. The
micro-step holds `max(token_budget, row)` tokens (a row longer than the budget trains alone)
and its attention `tokens x row` query-key pairs per head. Under Megatron's sequence
parallelism (`TrainLayout.sequence`, on by default at TP > 1) what lies outside the
tensor-parallel layers — the norms' inputs, outputs and float32 upcasts, the residual
stream, the input a column-parallel layer saves, the embedding's output, the hidden states
between stages — is this rank's slice of the sequence: those terms are divided by TP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

GB = 1e9
CHUNK_ELEMENTS = 1 << 25
"""`gyre.train.objective.CHUNK_ELEMENTS` (the log-probs' chunk; a test keeps them equal)."""
UPDATE_COPIES = 5
"""Float32 copies of the shard alive at the update's peak beyond the resident state: the
reduced sum, the 1/E-scaled gradient, the optimizer's own copy, AdamW's sqrt and denominator."""
GPU_RUNTIME_BYTES = int(1.5 * GB)
"""CUDA context, NCCL buffers and the caching allocator's slack on each GPU (an estimate,
not measured here: docs/gpu.md marks it unverified)."""

Backend = Literal["torch", "megatron"]
Dtype = Literal["float32", "bfloat16"]
Attention = Literal["sdpa", "local"]


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of `dtype` (float32, bfloat16, float16)."""
    return 4 if dtype == "float32" else 2


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shapes a model's memory depends on (its config.json): a Qwen2 / Llama / Qwen3
    dense decoder, or a Qwen3-MoE / Qwen2-MoE one (`experts` routed experts of width
    `moe_ffn`, `top_k` per token, Qwen2-MoE's gated shared expert of width `shared_ffn`)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Qwen3's per-head RMSNorm of queries and keys (`q_norm`, `k_norm`)."""
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face config dict (`config.json`, `PretrainedConfig.to_dict()`)."""
        from gyre.train.megatron import config as families  # torch-free

        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        experts = families.num_experts(hf)
        return cls(
            layers=int(hf["num_hidden_layers"]), hidden=hidden,
            ffn=0 if experts else int(hf["intermediate_size"]), heads=heads,
            kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads), vocab=int(hf["vocab_size"]),
            tied=bool(hf.get("tie_word_embeddings", False)), qkv_bias=families.qkv_bias(hf),
            qk_norm=families.qk_norm(hf), experts=experts,
            top_k=int(hf["num_experts_per_tok"]) if experts else 0,
            moe_ffn=int(hf["moe_intermediate_size"]) if experts else 0,
            shared_ffn=families.shared_expert_size(hf),
        )  # fmt: skip

    def layer_parameters(self, tp: int = 1) -> int:
        """One decoder layer's parameters on a TP rank: the projections and experts split
        over TP; the two norms, the q/k norms, the router and the shared expert's gate
        replicated."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = (q + 2 * kv) * (self.hidden + self.qkv_bias)
        mlp = 3 * (self.ffn + self.experts * self.moe_ffn + self.shared_ffn) * self.hidden
        replicated = 2 * self.hidden + 2 * self.head_dim * self.qk_norm
        replicated += (self.experts + bool(self.shared_ffn)) * self.hidden
        return (qkv + q * self.hidden + mlp) // tp + replicated

    @property
    def parameters(self) -> int:
        """The whole model's parameters (a tied embedding counted once)."""
        emb = self.vocab * self.hidden
        return self.layers * self.layer_parameters() + emb * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True, slots=True)
class TrainLayout:
    """How a cell trains: backend, parallel sizes, dtype, attention and the micro-step."""

    backend: Backend = "torch"
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    dtype: Dtype = "float32"
    attention: Attention = "sdpa"
    """Megatron's core attention (`MegatronConfig.attention`); the torch backend's HF model
    always runs SDPA."""
    row_tokens: int = 32768
    """The longest row: `proxy.max_context_tokens`, or the model's own context if shorter."""
    token_budget: int = 16384
    """`train.token_budget`: padded tokens of a micro-step (a longer row trains alone)."""
    sequence: bool = False
    """Megatron's sequence parallelism (`train.parallel.sequence`, resolved: `ParallelDims`):
    the activations outside the tensor-parallel layers split over the TP ranks."""
    window: int = 1
    """Micro-steps a pass runs 1F1B through the pipeline stages (`schedule.window`, resolved
    for the run's stages: `ScheduleConfig.window_for`); stage s holds `in_flight(s)` of them."""

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def step_tokens(self) -> int:
        """Tokens of the largest micro-step."""
        return max(self.token_budget, self.row_tokens)

    def stage(self, shard: int) -> int:
        """The pipeline stage of cell rank `shard` (the same in every data replica)."""
        return shard // self.tensor % self.pipeline

    def in_flight(self, stage: int) -> int:
        """Micro-steps whose activations stage `stage` holds at once under 1F1B: its
        P - 1 - stage warm-up forwards and the one before its first backward, at most the
        window's (`gyre.schedule.pipeline.one_f_one_b`)."""
        return max(1, min(self.window, self.pipeline - stage))

    @property
    def sequence_split(self) -> int:
        """What divides the activations outside the tensor-parallel layers: TP under sequence
        parallelism, else 1 (replicated on every TP rank)."""
        return self.tensor if self.sequence and self.backend == "megatron" else 1


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One cell rank's predicted bytes, by part, and where its peak falls."""

    shard: int
    """The rank's place in its cell (Megatron: TP rank shard % TP of stage shard // TP)."""
    parameters: int
    parts: dict[str, int] = field(default_factory=dict)
    """weights, main, gradients, moments (resident); micro-step, update (transient)."""

    @property
    def resident(self) -> int:
        return sum(self.parts.get(k, 0) for k in ("weights", "main", "gradients", "moments"))

    @property
    def peak(self) -> int:
        return self.resident + max(self.parts.get("micro-step", 0), self.parts.get("update", 0))


def rank_parameters(shape: ModelShape, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters of one Megatron rank (TP shard of pipeline stage `stage`): its layers, the
    embedding on the first stage, the final norm and output layer on the last (the last stage
    keeps its own copy of a tied embedding when it is not also the first)."""
    emb = shape.vocab * shape.hidden // tp
    n = shape.layers // pp * shape.layer_parameters(tp)
    first, last = stage == 0, stage == pp - 1
    n += emb if first else 0
    if last:
        n += shape.hidden + (emb if not shape.tied or not first else 0)
    return n


def layer_activation_bytes(shape: ModelShape, layout: TrainLayout, tokens: int) -> int:
    """What autograd saves in one decoder layer for `tokens` tokens (linear terms: the
    per-token coefficients counted in a real forward; `local`'s quadratic part apart)."""
    b, tp = dtype_bytes(layout.dtype), layout.tensor
    h = shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if layout.backend == "torch":  # Hugging Face's layer (its RMSNorm upcasts)
        per = b * (6 * h + 2 * q + 2 * kv) + (4 * h if b == 2 else 0)
        per += (q + kv) * (b + 4) * shape.qk_norm
    else:  # Megatron's local spec: norms replicated (split along the sequence under sequence
        # parallelism), the rest split over TP (the q/k norms see their rank's heads)
        rep = b * 6 * h + (8 * h if b == 2 else 0)
        per = rep // layout.sequence_split + b * (4 * q + 3 * kv) // tp
        per += (q + kv) * 8 * shape.qk_norm // tp
    per += _mlp_activation_bytes(shape, layout)
    return tokens * (per + 4 * shape.heads // tp + 8)


def _mlp_activation_bytes(shape: ModelShape, layout: TrainLayout) -> int:
    """Per token: the dense MLP's, or the MoE layer's — each of its `top_k` expert rows (the
    token dispatched, the expert's MLP, its weighted output), the router's float32 scores
    over the experts, and the shared expert beside them."""
    b, tp, h = dtype_bytes(layout.dtype), layout.tensor, shape.hidden
    torch_ = layout.backend == "torch"
    mlp = (4 if torch_ else 5) * b * (shape.ffn + shape.shared_ffn) // (1 if torch_ else tp)
    if not shape.experts:
        return mlp
    if torch_:  # transformers' loop over the hit experts (the rows' indices kept, int64)
        rows = 4 * b * shape.moe_ffn + 2 * b * h + 60
        shared = b * h if shape.shared_ffn else 0
    else:  # Megatron's all-gather dispatcher and SequentialMLP
        rows = 6 * b * shape.moe_ffn // tp + b * h + 48
        shared = 0
    return mlp + shape.top_k * rows + 4 * shape.experts // layout.sequence_split + shared


def outer_activation_bytes(shape: ModelShape, layout: TrainLayout, tokens: int) -> int:
    """What autograd saves outside the layers: the embedding's output (or the hidden states
    a stage receives) and the final norm (its float32 upcast under bfloat16); this rank's
    slice of the sequence under sequence parallelism."""
    b = dtype_bytes(layout.dtype)
    return tokens * shape.hidden * (3 * b + (4 if b == 2 else 0)) // layout.sequence_split


def attention_scores_bytes(shape: ModelShape, layout: TrainLayout) -> tuple[int, int]:
    """`local` attention's (saved per layer, transient once) bytes: the probabilities each
    layer saves (float32, and the bfloat16 copy under bfloat16), and the scores buffer, the
    causal mask and two float32 gradients of the layer in backward. (0, 0) for sdpa."""
    if layout.backend != "megatron" or layout.attention != "local":
        return 0, 0
    pairs = layout.step_tokens * layout.row_tokens * (shape.heads // layout.tensor)
    b = dtype_bytes(layout.dtype)
    saved = pairs * (4 + (b if b == 2 else 0))
    return saved, pairs * (b + 8) + layout.row_tokens**2


def micro_step_bytes(shape: ModelShape, layout: TrainLayout, stage: int = 0) -> int:
    """Peak transient bytes of a phase-B window (forwards, log-probs, backwards) on a rank of
    pipeline stage `stage`: the saved activations of the micro-steps it holds at once
    (`TrainLayout.in_flight`), the hidden states and input gradients of the window's earlier
    micro-steps that their sends hold until the window ends (`run_window`), and one
    micro-step's transients. A window of one: one micro-step's peak."""
    b, tp, pp, tokens = (
        dtype_bytes(layout.dtype),
        layout.tensor,
        layout.pipeline,
        layout.step_tokens,
    )
    layers = shape.layers // pp
    saved_scores, scratch = attention_scores_bytes(shape, layout)
    acts = layers * (layer_activation_bytes(shape, layout, tokens) + saved_scores)
    acts += outer_activation_bytes(shape, layout, tokens)
    hidden = tokens * b * shape.hidden // layout.sequence_split
    sent = (layout.window - 1) * hidden * ((stage < pp - 1) + (stage > 0))
    acts = acts * layout.in_flight(stage) + sent
    if stage != pp - 1:  # a middle stage: its output and the gradient it receives
        return acts + max(scratch, 2 * hidden)
    logits = tokens * (shape.vocab // tp) * b
    chunk = min(CHUNK_ELEMENTS, tokens * (shape.vocab // tp)) * 4
    head_grad = (shape.vocab // tp) * shape.hidden * b + tokens * shape.hidden * b
    return acts + max(scratch, logits + max(logits + chunk, head_grad))


def plan_rank(shape: ModelShape, layout: TrainLayout, shard: int = 0, *, steps: bool) -> RankMemory:
    """Cell rank `shard`'s bytes; `steps`: it holds the optimizer (moments, main weights)."""
    stage = layout.stage(shard)
    if layout.backend == "torch":
        params = shape.parameters
    else:
        params = rank_parameters(shape, layout.tensor, layout.pipeline, stage)
    b = dtype_bytes(layout.dtype)
    parts = {"weights": params * b, "gradients": params * 4}
    if steps:
        parts["main"] = params * 4 if b != 4 else 0
        parts["moments"] = 8 * params
        parts["update"] = UPDATE_COPIES * 4 * params
    parts["micro-step"] = micro_step_bytes(shape, layout, stage)
    return RankMemory(shard=shard, parameters=params, parts=parts)


def plan_ranks(shape: ModelShape, layout: TrainLayout) -> list[RankMemory]:
    """Every rank of the core cell (the cell that steps; satellites hold less): the torch
    backend steps on the leader, Megatron on every rank of the first data-parallel replica."""
    stepping = layout.tensor * layout.pipeline if layout.backend == "megatron" else 1
    return [plan_rank(shape, layout, s, steps=s < stepping) for s in range(layout.ranks)]


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """One SGLang engine GPU: its static pool (`mem_fraction_static` of the GPU), the
    weights' share of it (bfloat16, split over `engine.tensor_parallel`), the KV pool."""

    static: int
    weights: int
    kv_bytes_per_token: int

    @property
    def kv_pool(self) -> int:
        return self.static - self.weights

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_pool) // self.kv_bytes_per_token


def plan_engine(shape: ModelShape, *, tensor_parallel: int, mem_fraction_static: float,
                gpu_bytes: int) -> EngineMemory:  # fmt: skip
    """An SGLang engine GPU of `gpu_bytes` (KV heads replicated where TP exceeds them)."""
    kv_heads = max(1, shape.kv_heads // tensor_parallel)
    return EngineMemory(
        static=int(mem_fraction_static * gpu_bytes),
        weights=shape.parameters * 2 // tensor_parallel,
        kv_bytes_per_token=2 * shape.layers * kv_heads * shape.head_dim * 2,
    )


def gb(n: float) -> str:
    """Bytes as GB (the plan's unit: 1 GB = 1e9 bytes): one decimal from 10 GB, more below."""
    x = n / GB
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


PART_ORDER = ("weights", "main", "gradients", "moments", "micro-step", "update")


def describe(rank: RankMemory) -> str:
    """`weights 17.5, main 35.0, ...` (GB): the parts of a rank's peak."""
    return ", ".join(f"{k} {gb(rank.parts[k])}" for k in PART_ORDER if rank.parts.get(k))


def layouts_that_fit(shape: ModelShape, layout: TrainLayout, limit: int, most_ranks: int = 64,
                     window_for: Callable[[int], int] | None = None) -> list[TrainLayout]:  # fmt: skip
    """Megatron layouts (TP up to 8, one node's GPUs; PP dividing the layers; sequence
    parallel at TP > 1, the default) of the fewest ranks whose every rank fits in `limit`
    bytes, TP preferred; the same dtype, attention and micro-step, and the window
    `window_for(stages)` (`ScheduleConfig.window_for`; None: the layout's)."""
    found: list[TrainLayout] = []
    for ranks in range(1, most_ranks + 1):
        for tp in (8, 4, 2, 1):
            if ranks % tp or not _shards(shape, tp) or shape.layers % (ranks // tp):
                continue
            pp = ranks // tp
            window = window_for(pp) if window_for is not None else layout.window
            cand = replace(layout, backend="megatron", tensor=tp, pipeline=pp, data=1,
                           sequence=tp > 1, window=window)  # fmt: skip
            # (sequence: train.parallel.sequence's default)
            if max(r.peak for r in plan_ranks(shape, cand)) <= limit:
                found.append(cand)
        if found:
            return found
    return found


def _shards(shape: ModelShape, tp: int) -> bool:
    """Whether Megatron splits this model over `tp` (heads, KV heads, MLP, vocabulary)."""
    widths = (shape.heads, shape.kv_heads, shape.ffn, shape.moe_ffn, shape.shared_ffn, shape.vocab)
    return not any(x % tp for x in widths)


def largest_budget(shape: ModelShape, layout: TrainLayout, limit: int) -> int | None:
    """The largest `token_budget` (a power of two >= 1024, at most the layout's) with which
    every rank fits in `limit`, rows capped at the budget; None when none does."""
    budget = 1 << (max(layout.token_budget, 1024).bit_length() - 1)
    while budget >= 1024:
        cand = replace(layout, token_budget=budget, row_tokens=min(layout.row_tokens, budget))
        if max(r.peak for r in plan_ranks(shape, cand)) <= limit:
            return budget
        budget //= 2
    return None


def largest_window(shape: ModelShape, layout: TrainLayout, limit: int) -> int | None:
    """The largest window below the layout's with which every rank fits in `limit`; None
    when none does (or the layout's is 1)."""
    for window in range(layout.window - 1, 0, -1):
        if max(r.peak for r in plan_ranks(shape, replace(layout, window=window))) <= limit:
            return window
    return None


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """A cell's memory on its devices: every core rank, the engine, the limit they meet."""

    shape: ModelShape
    layout: TrainLayout
    gpu: bool
    """Whether the ranks train on GPUs (one rank per GPU) — else on the CPU (one process each)."""
    limit: int | None
    """Bytes of one device (a GPU's memory, or a CPU rank's configured limit); None: none."""
    engine: EngineMemory | None = None
    """The SGLang engine of the cell (None: the embedded engine, another process on the CPU)."""
    colocated: bool = True
    """The engine shares the trainer's GPUs (they take turns: `topology.placement`)."""
    window_for: Callable[[int], int] | None = None
    """The window at a number of pipeline stages (`ScheduleConfig.window_for`), for the
    layouts `what_fits` proposes; None: they keep `layout.window`."""

    @property
    def ranks(self) -> list[RankMemory]:
        return plan_ranks(self.shape, self.layout)

    def device_bytes(self, rank: RankMemory) -> int:
        """What `rank`'s device holds at its peak: the trainer's peak on a GPU adds the CUDA
        runtime. A colocated engine's static pool takes the same GPU in turns (its own
        check: `engine_problem`)."""
        return rank.peak + (GPU_RUNTIME_BYTES if self.gpu else 0)

    def rank_problem(self) -> str | None:
        """The first rank that cannot fit, with its numbers and what would; None: all fit."""
        if self.limit is None:
            return None
        for rank in self.ranks:
            need = self.device_bytes(rank)
            if need > self.limit:
                return (f"rank {rank.shard} needs {gb(need)} GB > {gb(self.limit)} GB: "
                        f"{describe(rank)}{self._extra(rank)}; {self.what_fits()}")  # fmt: skip
        return None

    def _extra(self, rank: RankMemory) -> str:
        extra = self.device_bytes(rank) - rank.peak
        if not extra:
            return ""
        return f", CUDA runtime {gb(extra)}"

    def engine_problem(self) -> str | None:
        """An engine whose weights leave its static pool no room for one longest row."""
        e = self.engine
        if e is None or e.kv_tokens >= self.layout.row_tokens:
            return None
        return (f"the engine's static pool ({gb(e.static)} GB, mem_fraction_static of the GPU) "
                f"holds weights {gb(e.weights)} GB and KV for {e.kv_tokens} tokens < one row of "
                f"{self.layout.row_tokens}; raise engine.tensor_parallel or "
                "engine.mem_fraction_static")  # fmt: skip

    def what_fits(self) -> str:
        """`fits with tensor_parallel 8 or pipeline 4, or token_budget 4096` (the smallest)."""
        limit = self.limit or 0
        budget = limit - (GPU_RUNTIME_BYTES if self.gpu else 0)
        options = [f"train.parallel tensor {c.tensor} x pipeline {c.pipeline} "
                   f"({c.ranks} ranks per cell)"
                   for c in layouts_that_fit(self.shape, self.layout, budget,
                                             window_for=self.window_for)[:3]]  # fmt: skip
        window = largest_window(self.shape, self.layout, budget)
        if window is not None:
            options.append(f"schedule.window {window}")
        tokens = largest_budget(self.shape, self.layout, budget)
        if tokens is not None:
            options.append(f"train.token_budget {tokens} with rows of at most {tokens} tokens "
                           "(proxy.max_context_tokens)")  # fmt: skip
        if not options:
            return "no layout of <= 64 ranks fits"
        how = "" if self.layout.backend == "megatron" else "train.backend megatron with "
        return f"fits with {how}" + " or ".join(options)


def _runs(plan: MemoryPlan) -> list[tuple[int, int, RankMemory]]:
    """Consecutive ranks with the same bytes, as (first, last, one of them)."""
    out: list[tuple[int, int, RankMemory]] = []
    for r in plan.ranks:
        key = (r.parts, r.parameters, plan.device_bytes(r))
        if out and (out[-1][2].parts, out[-1][2].parameters, plan.device_bytes(out[-1][2])) == key:
            out[-1] = (out[-1][0], r.shard, out[-1][2])
        else:
            out.append((r.shard, r.shard, r))
    return out


def render(plan: MemoryPlan) -> list[str]:
    """The plan as the lines `gyre plan --memory` prints (GB)."""
    s, lay = plan.shape, plan.layout
    lines = [
        f"model: {_count(s.parameters)} parameters ({s.layers} layers, hidden {s.hidden}, "
        f"{_mlp(s)}, heads {s.heads}/{s.kv_heads} KV, vocab {s.vocab})",
        f"train: backend {lay.backend}, tensor {lay.tensor} x pipeline {lay.pipeline} x data "
        f"{lay.data}, {lay.dtype}, attention {lay.attention if lay.backend == 'megatron' else 'sdpa'}; "
        f"micro-step {lay.step_tokens} tokens, longest row {lay.row_tokens}",
        _window_line(lay),
        "per rank of the core cell, GB (1e9 bytes); peak = resident + max(micro-step, update)",
        f"{'ranks':>5} {'params':>8} " + " ".join(f"{k:>10}" for k in PART_ORDER)
        + f" {'peak':>8} {'device':>8}",
    ]  # fmt: skip
    for first, last, r in _runs(plan):
        ranks = str(first) if first == last else f"{first}-{last}"
        lines.append(f"{ranks:>5} {r.parameters / 1e6:>7.1f}M "
                     + " ".join(f"{gb(r.parts.get(k, 0)):>10}" for k in PART_ORDER)
                     + f" {gb(r.peak):>8} {gb(plan.device_bytes(r)):>8}")  # fmt: skip
    if plan.engine is not None:
        e = plan.engine
        lines.append(f"engine GPU: static {gb(e.static)} GB = weights {gb(e.weights)} + KV pool "
                     f"{gb(e.kv_pool)} ({e.kv_tokens} tokens); "
                     f"{'takes turns with the trainer' if plan.colocated else 'own GPUs'}")  # fmt: skip
    where = "GPU" if plan.gpu else "CPU rank"
    limit = "no limit set: not enforced" if plan.limit is None else f"{gb(plan.limit)} GB"
    problem = plan.rank_problem() or plan.engine_problem()
    lines.append(f"limit per {where}: {limit}; " + (f"DOES NOT FIT: {problem}" if problem
                                                   else "fits"))  # fmt: skip
    return lines


def _window_line(lay: TrainLayout) -> str:
    """`window 8 (schedule.window), 1F1B: micro-steps in flight by stage, min(window, 4 -
    stage): 4 on stage 0, 3 on stage 1, ...` (stages alike as first-last)."""
    if lay.pipeline == 1:
        return f"window {lay.window} (schedule.window): one micro-step in flight"
    runs: list[list[int]] = []  # [first stage, last stage, count]
    for s in range(lay.pipeline):
        if runs and runs[-1][2] == lay.in_flight(s):
            runs[-1][1] = s
        else:
            runs.append([s, s, lay.in_flight(s)])
    where = [f"{n} on stage{f' {a}' if a == b else f's {a}-{b}'}" for a, b, n in runs]
    return (
        f"window {lay.window} (schedule.window), 1F1B: micro-steps in flight by stage, "
        f"min(window, {lay.pipeline} - stage): " + ", ".join(where)
    )


def _mlp(s: ModelShape) -> str:
    if not s.experts:
        return f"ffn {s.ffn}"
    shared = f" + shared {s.shared_ffn}" if s.shared_ffn else ""
    return f"{s.experts} experts of ffn {s.moe_ffn}, top {s.top_k}{shared}"


def _count(n: int) -> str:
    """A parameter count as people write it: 0.336 M, 494 M, 7.62 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.3g} M"
