"""Weight names and layouts: Hugging Face / rollout engines ↔ Megatron-core (with TP shards).

Rollout engines (Gyre's embedded engine and SGLang's loaders) take Hugging Face names and
separate tensors; Megatron fuses them:

* ``linear_qkv`` — per query group g (``num_query_groups`` of them), the group's
  ``heads/groups`` query heads, then its key head, then its value head, each ``head_dim``
  rows (weight ``[groups·(heads/groups+2)·head_dim, hidden]``, bias likewise). A
  tensor-parallel rank holds ``groups/TP`` whole groups.
* ``linear_fc1`` — ``[gate; up]`` stacked on dim 0 (SwiGLU: ``silu(gate(x)) · up(x)``); a TP
  rank holds ``[gate_shard; up_shard]``.
* ``linear_proj`` / ``linear_fc2`` are split on dim 1; embeddings / output layer on dim 0
  (vocabulary); norms are replicated, Qwen3's per-head ``q_norm`` / ``k_norm`` included
  (Megatron's ``q_layernorm`` / ``k_layernorm``, ``head_dim`` wide).
* Mixture of experts (Qwen3-MoE, Qwen2-MoE): the router ``mlp.gate`` is ``mlp.router``
  (replicated); routed expert j's ``gate_proj`` / ``up_proj`` / ``down_proj`` (the checkpoint's
  names, ``mlp.experts.{j}.*``) are ``mlp.experts.local_experts.{j}.linear_fc1`` (``[gate;
  up]``) / ``linear_fc2``, split over TP like the dense MLP — or, under expert parallelism
  (``WeightLayout.expert_parallel`` = EP, dividing TP), TP rank t holds the E/EP experts
  ``[b·E/EP, (b+1)·E/EP)`` of block b = t // ETP as ``local_experts.0..E/EP-1``, each split
  over the block's ETP = TP/EP ranks (rank t % ETP), as Megatron's ``SequentialMLP`` numbers
  them; Qwen2-MoE's ``shared_expert`` is
  ``mlp.shared_experts`` (the same fusion) and its ``shared_expert_gate`` is
  ``mlp.shared_experts.gate_weight``. transformers 5 holds a layer's experts in memory as two
  stacked tensors (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``mlp.experts.down_proj``
  ``[E, H, F]``): `InMemory` reads expert j's tensors out of them, and `module_names` stacks
  them back for such a model (a part sent to the embedded engine).

Names follow Megatron's *local* layer spec (``input_layernorm``, ``pre_mlp_layernorm``) or,
with ``fused_norms=True``, the Transformer-Engine spec (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``).

A TP rank's tensors are cut from its chunks of the Hugging Face tensors (whole query groups
are contiguous rows of q, k and v), so a rank reads only its slice of each tensor: from
whole tensors in memory (a `Mapping`) or straight from a model directory's safetensors
files (`gyre.train.megatron.shard_files`), the same bytes either way.

    layout = WeightLayout.from_hf_config(hf_config)
    shard = hf_to_mcore(hf_state, layout, tp_rank=0, tp_size=2)
    hf_state_again = mcore_to_hf([shard0, shard1], layout)        # exact round trip
    stage = stage_to_mcore(hf_state, layout, tp_rank=0, tp_size=1, stage=1, stages=2)
    hf_state_again = stages_to_hf([stage0, stage1], layout, tp_size=1)   # pipeline stages
    stage1_hf = stage_to_hf([stage1], layout, stage=1, stages=2)         # one stage's part
    for name, t in iter_stage_to_mcore(SafetensorsFiles(model_dir), layout, tp_rank=1,
                                       tp_size=2, stage=0, stages=1): ...  # one at a time
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gyre.errors import TrainingError
from gyre.rollout.weights import EXPERT as _EXPERT
from gyre.rollout.weights import from_stacked_experts as _from_stacked_experts
from gyre.train.megatron.config import num_experts, qk_norm, qkv_bias, shared_expert_size

Tensors = dict[str, torch.Tensor]


class TensorSource(Protocol):
    """Where a rank's Hugging Face tensors come from, one chunk at a time."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape (`TrainingError` naming it when there is no such tensor)."""
        ...

    def chunk(self, name: str, dim: int, rank: int, size: int) -> torch.Tensor:
        """Chunk `rank` of `size` equal chunks along `dim`, in memory of its own (`size` 1:
        the whole tensor); `size` divides the dimension."""
        ...


class InMemory:
    """Whole tensors in memory (a model's state dict) as a `TensorSource`."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._take(name).shape)

    def chunk(self, name: str, dim: int, rank: int, size: int) -> torch.Tensor:
        return self._take(name).chunk(size, dim=dim)[rank].clone()

    def _take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            stacked = _from_stacked_experts(self.tensors, name)
            if stacked is None:
                raise TrainingError(f"hf weights: {name!r} missing")
            return stacked
        return self.tensors[name]


def module_names(hf: Mapping[str, torch.Tensor], layout: WeightLayout) -> Tensors:
    """Checkpoint-named tensors (`mcore_to_hf`'s) renamed as transformers 5's MoE modules hold
    them: each layer's routed experts stacked into ``mlp.experts.gate_up_proj`` and
    ``mlp.experts.down_proj``; a dense model's tensors unchanged."""
    if not layout.experts:
        return dict(hf)
    out: Tensors = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in hf.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for base, by_j in experts.items():
        if sorted(by_j) != list(range(layout.experts)):
            raise TrainingError(f"{base}: experts {sorted(by_j)}; expected 0..{layout.experts - 1}")
        js = range(layout.experts)
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([by_j[j]["gate_proj"], by_j[j]["up_proj"]]) for j in js])  # fmt: skip
        out[f"{base}.down_proj"] = torch.stack([by_j[j]["down_proj"] for j in js])
    return out


Source = Mapping[str, torch.Tensor] | TensorSource
"""Whole tensors by name, or a `TensorSource` (e.g. a model directory's files)."""


def as_source(hf: Source) -> TensorSource:
    """`hf` as a `TensorSource` (whole tensors wrapped in `InMemory`)."""
    return InMemory(hf) if isinstance(hf, Mapping) else hf


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """The shapes that decide how tensors fuse and split."""

    num_layers: int
    heads: int
    groups: int
    head_dim: int
    qkv_bias: bool
    tied: bool
    fused_norms: bool = False
    qk_norm: bool = False
    """Per-head q/k RMSNorm weights (Qwen3)."""
    experts: int = 0
    """Routed experts per layer (0: a dense MLP)."""
    shared_expert: bool = False
    """A gated shared expert beside the routed ones (Qwen2-MoE)."""
    expert_parallel: int = 1
    """EP: the routed experts of a stage are split over the TP ranks in EP blocks of
    experts / EP whole experts (TP rank t holds block t // ETP, ETP = TP / EP), each expert
    cut over the block's ETP ranks (at rank t % ETP); 1: every TP rank a TP shard of every
    expert."""

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, fused_norms: bool = False,
                       expert_parallel: int = 1) -> WeightLayout:  # fmt: skip
        heads = int(hf["num_attention_heads"])
        return cls(
            num_layers=int(hf["num_hidden_layers"]),
            heads=heads,
            groups=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            qkv_bias=qkv_bias(hf),
            tied=bool(hf.get("tie_word_embeddings", False)),
            fused_norms=fused_norms,
            qk_norm=qk_norm(hf),
            experts=num_experts(hf),
            shared_expert=shared_expert_size(hf) > 0,
            expert_parallel=expert_parallel,
        )

    def expert_block(self, tp_rank: int, tp_size: int) -> tuple[range, int, int]:
        """TP rank `tp_rank`'s routed experts (global indices, in local order), its rank
        among the ranks that split them and their count (ETP)."""
        etp = tp_size // self.expert_parallel
        per = self.experts // self.expert_parallel
        block = tp_rank // etp
        return range(block * per, (block + 1) * per), tp_rank % etp, etp


def stage_layers(layout: WeightLayout, stage: int, stages: int) -> range:
    """The global layer indices pipeline stage `stage` of `stages` holds (equal blocks, in
    order, as Megatron splits them)."""
    if layout.num_layers % stages:
        raise TrainingError(f"{layout.num_layers} layers not divisible by pipeline {stages}")
    per = layout.num_layers // stages
    return range(stage * per, (stage + 1) * per)


def stage_to_mcore(hf: Source, layout: WeightLayout, *, tp_rank: int,
                   tp_size: int, stage: int, stages: int) -> Tensors:  # fmt: skip
    """`hf_to_mcore` for one TP rank of pipeline stage `stage` of `stages`."""
    return dict(iter_stage_to_mcore(hf, layout, tp_rank=tp_rank, tp_size=tp_size, stage=stage,
                                    stages=stages))  # fmt: skip


def iter_stage_to_mcore(hf: Source, layout: WeightLayout, *, tp_rank: int, tp_size: int,
                        stage: int, stages: int) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """`stage_to_mcore` one tensor at a time: a loader copies each into the model and drops
    it, so no more than one of the shard's tensors is held beside the model."""
    return _iter_hf_to_mcore(as_source(hf), layout, tp_rank=tp_rank, tp_size=tp_size,
                             layers=stage_layers(layout, stage, stages), first_stage=stage == 0,
                             last_stage=stage == stages - 1)  # fmt: skip


def stages_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], layout: WeightLayout, *,
                 tp_size: int) -> Tensors:  # fmt: skip
    """HF tensors from every rank's state dict of a TP x PP cell (rank s: TP rank
    s % tp_size of stage s // tp_size): `stage_to_hf` of each stage."""
    stages = len(shards) // tp_size
    out: Tensors = {}
    for stage in range(stages):
        out.update(stage_to_hf(shards[stage * tp_size : (stage + 1) * tp_size], layout,
                               stage=stage, stages=stages))  # fmt: skip
    return out


def stage_to_hf(tp_shards: Sequence[Mapping[str, torch.Tensor]], layout: WeightLayout, *,
                stage: int, stages: int) -> Tensors:  # fmt: skip
    """HF tensors of pipeline stage `stage` of `stages` from its TP ranks' state dicts (in TP
    order): its layers, the embedding on the first stage, the final norm (and an untied
    output layer) on the last. What a stage's sender publishes; `stages_to_hf` of a cell."""
    return mcore_to_hf(tp_shards, layout, layers=stage_layers(layout, stage, stages),
                       first_stage=stage == 0, last_stage=stage == stages - 1)  # fmt: skip


class ShardedSource(InMemory):
    """The shards of a TP x PP cell (shard s: TP rank s % tp_size of stage s // tp_size) as
    a `TensorSource` of HF tensors, put together one group at a time — a layer, the
    embedding, or the final norm with an untied output layer — from only that group's
    tensors of the shards that hold it: `read(s, names)` returns those of shard s's
    Megatron tensors (`names[s]` lists each shard's). A reader that asks group by group, as
    `hf_to_mcore` does, holds one layer of the whole model at once beside what it keeps
    (a resume at other sizes: the rank's own shard), never the model; `peak_bytes` is the
    most it held."""

    def __init__(self, layout: WeightLayout, *, tp_size: int, stages: int,
                 names: Sequence[Sequence[str]],
                 read: Callable[[int, Sequence[str]], Mapping[str, torch.Tensor]]) -> None:  # fmt: skip
        self.layout, self.tp_size, self.stages = layout, tp_size, stages
        self.names = [list(n) for n in names]
        self.read = read
        self.peak_bytes = 0
        self._group: tuple[str, int] | None = None
        super().__init__({})  # `tensors`: the group held

    def _take(self, name: str) -> torch.Tensor:
        group = _group_of(name)
        if group != self._group:
            self._group, self.tensors = None, {}  # the last group goes before the next comes
            self.tensors, self._group = self._load(group), group
            held = sum(t.numel() * t.element_size() for t in self.tensors.values())
            self.peak_bytes = max(self.peak_bytes, held)
        return super()._take(name)

    def _stage(self, stage: int, names: Callable[[str], str | None]) -> list[Tensors]:
        """Stage `stage`'s TP shards, each only the tensors `names` renames (None: not read)."""
        out = []
        for s in range(stage * self.tp_size, (stage + 1) * self.tp_size):
            wanted = {n: new for n in self.names[s] if (new := names(n)) is not None}
            out.append({wanted[n]: t for n, t in self.read(s, list(wanted)).items()})
        return out

    def _load(self, group: tuple[str, int]) -> Tensors:
        kind, i = group
        if kind == "layer":
            per = self.layout.num_layers // self.stages
            prefix = f"decoder.layers.{i % per}."
            shards = self._stage(i // per, lambda n: "decoder.layers.0." + n[len(prefix):]
                                 if n.startswith(prefix) else None)  # fmt: skip
            return dict(_layer_to_hf(shards, self.layout, 0, i))
        if kind == "first":
            name = "embedding.word_embeddings.weight"
            shards = self._stage(0, lambda n: n if n == name else None)
            return {"model.embed_tokens.weight": _cat(shards, name, 0)}
        last = ("decoder.final_layernorm.weight", "output_layer.weight")
        shards = self._stage(self.stages - 1, lambda n: n if n in last else None)
        out = {"model.norm.weight": shards[0][last[0]]}
        if not self.layout.tied:
            out["lm_head.weight"] = _cat(shards, last[1], 0)
        return out


def _group_of(name: str) -> tuple[str, int]:
    """The `ShardedSource` group an HF tensor belongs to."""
    if name.startswith("model.layers."):
        return "layer", int(name.split(".")[2])
    return ("first", 0) if name == "model.embed_tokens.weight" else ("last", 0)


def _norm_names(layout: WeightLayout, i: int) -> tuple[str, str]:
    d = f"decoder.layers.{i}"
    if layout.fused_norms:  # the TE spec keeps an MoE layer's pre-MLP norm apart
        return (
            f"{d}.self_attention.linear_qkv.layer_norm_weight",
            f"{d}.pre_mlp_layernorm.weight" if layout.experts
            else f"{d}.mlp.linear_fc1.layer_norm_weight",
        )  # fmt: skip
    return f"{d}.input_layernorm.weight", f"{d}.pre_mlp_layernorm.weight"


def _split(hf: TensorSource, name: str, dim: int, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank`'s chunk of HF tensor `name` along `dim`."""
    shape = hf.shape(name)
    if shape[dim] % size:
        raise TrainingError(f"{name}: dim {dim} of {shape} not divisible by TP {size}")
    return hf.chunk(name, dim, rank, size)


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: WeightLayout,
    groups: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """HF q/k/v (weights [out, in] or biases [out]) → Megatron's grouped linear_qkv (of
    `groups` query groups: a TP rank's chunks of q, k and v hold groups/TP whole groups)."""
    g = layout.groups if groups is None else groups
    per = layout.heads // layout.groups
    rest = q.shape[1:]
    qg = q.reshape(g, per * layout.head_dim, *rest)
    kg = k.reshape(g, layout.head_dim, *rest)
    vg = v.reshape(g, layout.head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, layout: WeightLayout, groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv` (for `groups` query groups: a TP shard holds fewer)."""
    g = layout.groups if groups is None else groups
    per, hd = layout.heads // layout.groups, layout.head_dim
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (per + 2) * hd, *rest)
    q, k, v = x.split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layer_to_mcore(hf: TensorSource, layout: WeightLayout, i: int, local: int, rank: int,
                    size: int) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    h, d = f"model.layers.{i}", f"decoder.layers.{local}"
    ln1, ln2 = _norm_names(layout, local)
    yield ln1, hf.chunk(f"{h}.input_layernorm.weight", 0, 0, 1)
    yield ln2, hf.chunk(f"{h}.post_attention_layernorm.weight", 0, 0, 1)
    for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
        q, k, v = (_split(hf, f"{h}.self_attn.{p}_proj.{kind}", 0, rank, size) for p in "qkv")
        yield f"{d}.self_attention.linear_qkv.{kind}", fuse_qkv(q, k, v, layout,
                                                                layout.groups // size)  # fmt: skip
    if layout.qk_norm:
        for p in "qk":
            yield f"{d}.self_attention.{p}_layernorm.weight", hf.chunk(
                f"{h}.self_attn.{p}_norm.weight", 0, 0, 1)  # fmt: skip
    yield f"{d}.self_attention.linear_proj.weight", _split(hf, f"{h}.self_attn.o_proj.weight",
                                                           1, rank, size)  # fmt: skip
    if not layout.experts:
        yield from _mlp_to_mcore(hf, f"{h}.mlp", f"{d}.mlp", rank, size)
        return
    yield f"{d}.mlp.router.weight", hf.chunk(f"{h}.mlp.gate.weight", 0, 0, 1)
    experts, e_rank, e_size = layout.expert_block(rank, size)
    for local_j, j in enumerate(experts):
        mine = f"{d}.mlp.experts.local_experts.{local_j}"
        yield from _mlp_to_mcore(hf, f"{h}.mlp.experts.{j}", mine, e_rank, e_size)
    if layout.shared_expert:
        yield from _mlp_to_mcore(hf, f"{h}.mlp.shared_expert", f"{d}.mlp.shared_experts", rank,
                                 size)  # fmt: skip
        yield f"{d}.mlp.shared_experts.gate_weight", hf.chunk(
            f"{h}.mlp.shared_expert_gate.weight", 0, 0, 1)  # fmt: skip


def _mlp_to_mcore(hf: TensorSource, h: str, d: str, rank: int,
                  size: int) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """A SwiGLU MLP (HF prefix `h`, Megatron prefix `d`): ``[gate; up]`` and down."""
    gate = _split(hf, f"{h}.gate_proj.weight", 0, rank, size)
    up = _split(hf, f"{h}.up_proj.weight", 0, rank, size)
    yield f"{d}.linear_fc1.weight", torch.cat([gate, up], dim=0)
    yield f"{d}.linear_fc2.weight", _split(hf, f"{h}.down_proj.weight", 1, rank, size)


def hf_to_mcore(
    hf: Source,
    layout: WeightLayout,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: Sequence[int] | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
) -> Tensors:
    """One TP rank's (and pipeline stage's) Megatron state dict, reading only that rank's
    chunk of each Hugging Face tensor (whole tensors or a `TensorSource`)."""
    return dict(_iter_hf_to_mcore(as_source(hf), layout, tp_rank=tp_rank, tp_size=tp_size,
                                  layers=layers if layers is not None else range(layout.num_layers),
                                  first_stage=first_stage, last_stage=last_stage))  # fmt: skip


def _iter_hf_to_mcore(hf: TensorSource, layout: WeightLayout, *, tp_rank: int, tp_size: int,
                      layers: Sequence[int], first_stage: bool,
                      last_stage: bool) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    if not 0 <= tp_rank < tp_size:
        raise TrainingError(f"tp_rank: {tp_rank}; allowed 0..{tp_size - 1}")
    if layout.groups % tp_size:
        raise TrainingError(f"query groups {layout.groups} not divisible by TP {tp_size}")
    _check_experts(layout, tp_size)
    emb = "model.embed_tokens.weight"
    if first_stage:
        yield "embedding.word_embeddings.weight", _split(hf, emb, 0, tp_rank, tp_size)
    for local, i in enumerate(layers):
        yield from _layer_to_mcore(hf, layout, i, local, tp_rank, tp_size)
    if last_stage:
        yield "decoder.final_layernorm.weight", hf.chunk("model.norm.weight", 0, 0, 1)
        if not layout.tied:
            yield "output_layer.weight", _split(hf, "lm_head.weight", 0, tp_rank, tp_size)
        elif not first_stage:  # the last stage keeps its own copy of the tied embedding
            yield "output_layer.weight", _split(hf, emb, 0, tp_rank, tp_size)


def _check_experts(layout: WeightLayout, tp_size: int) -> None:
    ep = layout.expert_parallel
    if ep != 1 and (tp_size % ep or not layout.experts or layout.experts % ep):
        raise TrainingError(f"expert parallel {ep}: does not divide TP {tp_size} and the "
                            f"{layout.experts} routed experts")  # fmt: skip


def _cat(shards: Sequence[Mapping[str, torch.Tensor]], name: str, dim: int) -> torch.Tensor:
    try:
        return torch.cat([s[name] for s in shards], dim=dim)
    except KeyError as e:
        raise TrainingError(f"megatron weights: {name!r} missing in a TP shard") from e


def _layer_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], layout: WeightLayout, local: int,
                 i: int) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    h, d = f"model.layers.{i}", f"decoder.layers.{local}"
    ln1, ln2 = _norm_names(layout, local)
    yield f"{h}.input_layernorm.weight", shards[0][ln1]
    yield f"{h}.post_attention_layernorm.weight", shards[0][ln2]
    per_rank = layout.groups // len(shards)
    for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
        parts = [split_qkv(s[f"{d}.self_attention.linear_qkv.{kind}"], layout, per_rank)
                 for s in shards]  # fmt: skip
        for j, p in enumerate("qkv"):
            yield f"{h}.self_attn.{p}_proj.{kind}", torch.cat([x[j] for x in parts], dim=0)
    if layout.qk_norm:
        for p in "qk":
            yield (
                f"{h}.self_attn.{p}_norm.weight",
                _one(shards, f"{d}.self_attention.{p}_layernorm.weight"),
            )
    yield f"{h}.self_attn.o_proj.weight", _cat(shards, f"{d}.self_attention.linear_proj.weight", 1)
    if not layout.experts:
        yield from _mlp_to_hf(shards, f"{h}.mlp", f"{d}.mlp")
        return
    yield f"{h}.mlp.gate.weight", _one(shards, f"{d}.mlp.router.weight")
    for block in range(0, len(shards), len(shards) // layout.expert_parallel):
        experts, _, etp = layout.expert_block(block, len(shards))
        for local_j, j in enumerate(experts):
            yield from _mlp_to_hf(shards[block : block + etp], f"{h}.mlp.experts.{j}",
                                  f"{d}.mlp.experts.local_experts.{local_j}")  # fmt: skip
    if layout.shared_expert:
        yield from _mlp_to_hf(shards, f"{h}.mlp.shared_expert", f"{d}.mlp.shared_experts")
        yield (
            f"{h}.mlp.shared_expert_gate.weight",
            _one(shards, f"{d}.mlp.shared_experts.gate_weight"),
        )


def _one(shards: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    """A tensor replicated over the TP ranks: TP rank 0's."""
    if name not in shards[0]:
        raise TrainingError(f"megatron weights: {name!r} missing in a TP shard")
    return shards[0][name]


def _mlp_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], h: str,
               d: str) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    halves = [s[f"{d}.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
    yield f"{h}.gate_proj.weight", torch.cat([x[0] for x in halves], dim=0)
    yield f"{h}.up_proj.weight", torch.cat([x[1] for x in halves], dim=0)
    yield f"{h}.down_proj.weight", _cat(shards, f"{d}.linear_fc2.weight", 1)


def mcore_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]],
    layout: WeightLayout,
    *,
    layers: Sequence[int] | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
) -> Tensors:
    """HF tensors (the engines' layout) from all TP ranks' state dicts of one stage."""
    if not shards:
        raise TrainingError("mcore_to_hf: no TP shards given")
    _check_experts(layout, len(shards))
    out: Tensors = {}
    if first_stage:
        out["model.embed_tokens.weight"] = _cat(shards, "embedding.word_embeddings.weight", 0)
    for local, i in enumerate(layers if layers is not None else range(layout.num_layers)):
        out.update(_layer_to_hf(shards, layout, local, i))
    if last_stage:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
        if not layout.tied:
            out["lm_head.weight"] = _cat(shards, "output_layer.weight", 0)
    return out


def hf_model_config(hf_config: Mapping[str, Any], dtype: str | None = None) -> Any:
    """The transformers config object of an HF config dict (`PretrainedConfig.to_dict`'s),
    saying `dtype` where given (the dtype of the weights a policy holds)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**dict(hf_config))
    if dtype is not None:
        config.dtype = dtype
    return config


def hf_shapes(hf_config: Mapping[str, Any]) -> list[tuple[str, torch.Size]]:
    """The trainable parameters' names and shapes of the Hugging Face model of `hf_config`,
    in its `named_parameters()` order (the HF flat order; tied weights once, MoE experts as
    the modules stack them), from a skeleton on the meta device: no weights are allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_model_config(hf_config))
    return [(n, p.shape) for n, p in skeleton.named_parameters() if p.requires_grad]


def hf_order(hf_config: Mapping[str, Any]) -> list[str]:
    """The names of `hf_shapes`, in order."""
    return [n for n, _ in hf_shapes(hf_config)]


def tensor_state(module: torch.nn.Module) -> Tensors:
    """A module's state dict without Megatron's ``_extra_state`` entries (tensors only)."""
    return {
        k: v for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }  # fmt: skip
