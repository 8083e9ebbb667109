"""HF config → Megatron TransformerConfig mapping, the prefix process-group layout, and a
cell's TP x PP x DP layout against Megatron's own rank groups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import load
from gyre.errors import ConfigError, TrainingError
from gyre.train.config import ParallelDims
from gyre.train.megatron.config import MegatronConfig, gpt_kwargs, transformer_kwargs
from gyre.train.megatron.groups import GroupLayout

QWEN = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "max_position_embeddings": 32768,
}  # fmt: skip


def test_qwen2_maps_to_megatron_fields():
    tk = transformer_kwargs(QWEN, MegatronConfig(tensor_parallel=2))
    assert tk["num_query_groups"] == 2 and tk["kv_channels"] == 64
    assert tk["ffn_hidden_size"] == 4864 and tk["add_qkv_bias"] and not tk["add_bias_linear"]
    assert tk["gated_linear_unit"] and tk["normalization"] == "RMSNorm"
    gk = gpt_kwargs(QWEN)
    assert gk["rotary_base"] == 1000000 and gk["share_embeddings_and_output_weights"]
    llama = {**QWEN, "model_type": "llama", "rope_theta": None,
             "rope_parameters": {"rope_theta": 500000.0}}  # fmt: skip
    assert not transformer_kwargs(llama, MegatronConfig())["add_qkv_bias"]
    assert gpt_kwargs(llama)["rotary_base"] == 500000


def test_bad_configs_are_named():
    with pytest.raises(ConfigError, match="model_type: 'gpt2'; allowed qwen2, llama"):
        transformer_kwargs({**QWEN, "model_type": "gpt2"}, MegatronConfig())
    with pytest.raises(
        ConfigError, match="num_attention_heads: 14 not divisible by tensor_parallel 4"
    ):
        transformer_kwargs(QWEN, MegatronConfig(tensor_parallel=4))
    with pytest.raises(ConfigError, match="tensor_parallel"):
        load(MegatronConfig, {"tensor_parallel": 0}, "train.megatron")
    with pytest.raises(ConfigError, match="dtype"):
        MegatronConfig(dtype="int8")  # type: ignore[arg-type]


def _mpi_prefix_reference(cell_of_rank, m, shard):
    """What gyre.train.comm's Split produces: shard position within a cell, cells in order."""
    members = []
    for cid in range(m):
        ranks = [r for r, c in enumerate(cell_of_rank) if c == cid]
        members.append(ranks[shard])
    return members


@given(
    cells=st.integers(1, 5),
    per=st.integers(1, 4),
    extras=st.integers(0, 2),
    seed=st.randoms(use_true_random=False),
)
def test_prefix_groups_match_mpi_prefix_communicators(cells, per, extras, seed):
    cell_of_rank: list[int | None] = [None] * extras + [c for c in range(cells) for _ in range(per)]
    seed.shuffle(cell_of_rank)
    lay = GroupLayout.from_cell_of_rank(cell_of_rank)
    assert lay.num_cells == cells and lay.ranks_per_cell == per
    dist_ranks = sorted(lay.dist_rank(r) for r, c in enumerate(cell_of_rank) if c is not None)
    assert dist_ranks == list(range(cells * per))
    groups = lay.all_groups()
    assert len(groups) == cells + (cells - 1) * per
    for m in range(2, cells + 1):
        for shard in range(per):
            ref = _mpi_prefix_reference(cell_of_rank, m, shard)
            assert lay.prefix_ranks(m, shard=shard) == ref
            assert ("prefix", m, shard, [lay.dist_rank(r) for r in ref]) in groups


def _megatron_groups(cells: int, dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Megatron's own groups (`parallel_state.RankGenerator`, what
    `initialize_model_parallel(order="tp-cp-ep-pp-dp")` builds) over a world of `cells`
    contiguous cells: the dense ones, and the experts' (EP x expert-TP folded onto TP)."""
    from megatron.core.parallel_state import RankGenerator

    order, world = "tp-cp-ep-pp-dp", cells * dims.ranks
    dense = RankGenerator(tp=dims.tensor, ep=1, dp=world // dims.model_parallel,
                          pp=dims.pipeline, cp=1, order=order)  # fmt: skip
    etp = dims.tensor // dims.expert
    experts = RankGenerator(tp=etp, ep=dims.expert, dp=world // (dims.model_parallel),
                            pp=dims.pipeline, cp=1, order=order)  # fmt: skip
    return {**{k: dense.get_ranks(k) for k in ("tp", "pp", "dp", "tp-pp")},
            "ep": experts.get_ranks("ep")}  # fmt: skip


def _index_in(groups: list[list[int]], rank: int) -> tuple[list[int], int]:
    (group,) = [g for g in groups if rank in g]
    return group, group.index(rank)


@settings(deadline=None)  # the first example imports megatron-core
@given(cells=st.integers(1, 3), tensor=st.sampled_from([1, 2, 4]), pipeline=st.integers(1, 3),
       data=st.integers(1, 3), expert_split=st.sampled_from([1, 2, 4]))  # fmt: skip
def test_a_cells_replicas_are_megatrons_data_parallel_ranks_inside_the_cell(
    cells: int, tensor: int, pipeline: int, data: int, expert_split: int
) -> None:
    """`ParallelDims.place` (what Gyre's cell ranks, shard loads and `split_replicas` use) is
    where Megatron puts every rank of a world of contiguous cells: its TP rank, stage,
    data-parallel rank cell x data + replica and expert-parallel rank; a cell's replica group
    at a shard position (the MPI Split: colour `place.position`, key the shard) is Megatron's
    data-parallel group cut to the cell, in its order, and a replica's TP, PP and model-
    parallel groups lie inside the cell."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra gyre[gpu])")
    expert = min(expert_split, tensor)
    dims = ParallelDims(tensor=tensor, pipeline=pipeline, data=data, expert=expert)
    groups = _megatron_groups(cells, dims)
    per = dims.ranks
    for rank in range(cells * per):
        cell, shard = divmod(rank, per)
        place = dims.place(shard)
        assert _index_in(groups["tp"], rank)[1] == place.tensor
        assert _index_in(groups["pp"], rank)[1] == place.stage
        dp_group, dp_rank = _index_in(groups["dp"], rank)
        assert dp_rank == cell * data + place.data
        assert _index_in(groups["ep"], rank)[1] == place.tensor // (tensor // expert)
        replicas = sorted(s for s in range(per) if dims.place(s).position == place.position)
        assert [cell * per + s for s in replicas] == [r for r in dp_group if r // per == cell]
        assert len(replicas) == data and replicas[0] == place.position  # replica 0 first
        for kind in ("tp", "pp", "tp-pp"):  # one replica of the model: inside the cell
            group = _index_in(groups[kind], rank)[0]
            assert {r // per for r in group} == {cell}
            assert {dims.place(r % per).data for r in group} == {place.data}


def test_a_rank_outside_the_cell_has_no_place() -> None:
    with pytest.raises(ValueError, match=r"shard: 4; allowed 0\.\.3"):
        ParallelDims(tensor=2, pipeline=1, data=2).place(4)


def test_uneven_cells_rejected():
    with pytest.raises(TrainingError, match="different sizes"):
        GroupLayout.from_cell_of_rank([None, 0, 0, 1])
    with pytest.raises(TrainingError, match=r"0\.\.K-1"):
        GroupLayout.from_cell_of_rank([None, 1, 2])


GROUP_WORKER = """
import json, os, sys, torch, torch.distributed as dist
from gyre.train.megatron.groups import GroupLayout, broadcast_from_core, build_prefix_groups
from gyre.train.megatron.groups import reduce_to_core
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=6)
layout = GroupLayout.from_cell_of_rank([None, 0, 0, 1, 1, 2, 2])  # MPI world: + coordinator
groups = build_prefix_groups(layout, backend="gloo")
mine = float(groups.cell_id * 10 + groups.shard + 1)
out = {"cell": groups.cell_id, "shard": groups.shard, "prefix": sorted(groups.prefix)}
for m in (2, 3):
    if groups.cell_id < m:
        g = reduce_to_core(groups, torch.tensor([mine]), participants=m)
        p = torch.tensor([mine if groups.cell_id == 0 else -1.0])
        broadcast_from_core(groups, p, participants=m)
        out[f"reduce{m}"], out[f"bcast{m}"] = float(g[0]), float(p[0])
dist.barrier()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_prefix_groups_reduce_and_broadcast_between_processes(tmp_path):
    """Six real ranks (3 cells x 2 shards) build the groups with gloo; the core's ranks get
    the per-shard sums over the prefix and satellites get the core's values."""
    import json
    import subprocess
    import sys

    from processes import rendezvous

    url = rendezvous(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", GROUP_WORKER, url, str(r)],
                              stdout=subprocess.PIPE, text=True) for r in range(6)]  # fmt: skip
    try:
        outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for o in outs:
        c, sh = o["cell"], o["shard"]
        assert o["prefix"] == [m for m in (2, 3) if c < m]
        if c == 0:  # the core: sums over cells 0..m-1 at its shard position
            assert o["reduce2"] == (sh + 1) + (10 + sh + 1)
            assert o["reduce3"] == (sh + 1) + (10 + sh + 1) + (20 + sh + 1)
        for m in (2, 3):
            if c < m:
                assert o[f"bcast{m}"] == sh + 1
