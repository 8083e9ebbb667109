"""Device placement of a node's ranks, local-rank discovery, and the colocated trainer's
offload / restore on each role switch (on CPU, through a fake device map)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError, TrainingError
from gyre.runtime.cell.residency import TrainerResidency
from gyre.runtime.shared.layout import Component
from gyre.runtime.shared.placement import (
    EngineGpus,
    RankDevice,
    engine_hosts,
    local_rank,
    node_ranks,
    plan_node,
)
from gyre.train.cell import CoreOptimizer, OptimConfig, TorchCell
from gyre.train.config import ObjectiveConfig

COORD, PROXY = Component("coordinator"), Component("proxy")


def cell(c: int, shard: int) -> Component:
    return Component("cell", c, shard)


def test_four_gpus_two_cells_of_two_ranks_colocated_with_tp2_engines() -> None:
    ranks = [COORD, PROXY, cell(0, 0), cell(0, 1), cell(1, 0), cell(1, 1)]
    plan = plan_node(4, ranks, tensor_parallel=2, mode="colocated")
    assert [r.device for r in plan.ranks] == ["cpu", "cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert plan[2].engine == EngineGpus(base_gpu_id=0, gpus=(0, 1))
    assert plan[4].engine == EngineGpus(base_gpu_id=2, gpus=(2, 3))
    assert [r.engine for r in (plan[0], plan[1], plan[3], plan[5])] == [None] * 4
    assert [r.offload for r in plan.ranks] == [False, False, True, True, True, True]
    assert plan.used == 4


def test_disjoint_where_it_fits_engine_gpus_follow_the_cells_trainers() -> None:
    plan = plan_node(4, [cell(0, 1), cell(0, 0)], tensor_parallel=2, mode="disjoint")
    assert plan[1] == RankDevice(1, cell(0, 0), "cuda:0", EngineGpus(2, (2, 3)), offload=False)
    assert plan[0] == RankDevice(0, cell(0, 1), "cuda:1")
    one_each = plan_node(4, [cell(0, 0), cell(1, 0)], tensor_parallel=1, mode="disjoint")
    assert [(r.device, r.engine) for r in one_each.ranks] == [
        ("cuda:0", EngineGpus(1, (1,))),
        ("cuda:2", EngineGpus(3, (3,))),
    ]


def test_disjoint_where_it_does_not_fit_names_the_counts() -> None:
    ranks = [cell(0, 0), cell(0, 1), cell(1, 0), cell(1, 1)]
    with pytest.raises(ConfigError) as err:
        plan_node(4, ranks, tensor_parallel=2, mode="disjoint")
    assert str(err.value).startswith(
        "this node has 4 GPUs but disjoint placement of its 4 trainer ranks and 2 engines with "
        "tensor_parallel 2 needs 8 (trainer ranks + engines x tensor_parallel)"
    )
    with pytest.raises(ConfigError, match=r"has 3 GPUs but colocated .* needs 4"):
        plan_node(3, ranks, tensor_parallel=2, mode="colocated")


def test_no_gpus_puts_everything_on_the_cpu_and_bad_arguments_are_errors() -> None:
    plan = plan_node(0, [COORD, cell(0, 0)], tensor_parallel=4, mode="disjoint")
    assert [r.device for r in plan.ranks] == ["cpu", "cpu"] and plan[1].engine is None
    with pytest.raises(ConfigError, match="placement mode: 'shared'; allowed: disjoint"):
        plan_node(4, [], tensor_parallel=1, mode="shared")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tensor_parallel: 0"):
        plan_node(4, [], tensor_parallel=0, mode="disjoint")


def _need(cells: list[int], standalone: int, tp: int, mode: str) -> int:
    """GPUs a node needs, from the definitions (every cell's leader is on the node)."""
    if mode == "disjoint":
        return sum(cells) + (len(cells) + standalone) * tp
    return sum(max(r, tp) for r in cells) + standalone * tp


@settings(max_examples=300, deadline=None)
@given(
    cells=st.lists(st.integers(1, 4), min_size=0, max_size=4),
    standalone=st.integers(0, 2),
    tp=st.integers(1, 4),
    gpus=st.integers(0, 24),
    mode=st.sampled_from(["disjoint", "colocated"]),
    data=st.data(),
)
def test_placement_properties(cells, standalone, tp, gpus, mode, data) -> None:
    comps = [COORD, PROXY] + [cell(c, s) for c, r in enumerate(cells) for s in range(r)]
    comps += [Component("standalone", j) for j in range(standalone)]
    comps = data.draw(st.permutations(comps))  # the launcher's local order is arbitrary
    need = _need(cells, standalone, tp, mode)
    if 0 < gpus < need:
        with pytest.raises(ConfigError, match=f"has {gpus} GPUs .* needs {need} "):
            plan_node(gpus, comps, tensor_parallel=tp, mode=mode)
        return
    plan = plan_node(gpus, comps, tensor_parallel=tp, mode=mode)
    trainers = [r for r in plan.ranks if r.component.kind == "cell"]
    engines = [r.engine for r in plan.ranks if r.engine is not None]
    if gpus == 0:
        assert all(r.device == "cpu" for r in plan.ranks) and not engines
        return
    devices = [r.device for r in trainers]
    assert len(set(devices)) == len(devices)  # no two trainer ranks share a device
    assert len(engines) == len(cells) + standalone
    engine_gpus = [g for e in engines for g in e.gpus]
    assert len(set(engine_gpus)) == len(engine_gpus)  # engines never share a GPU
    for e in engines:
        assert e.gpus == tuple(range(e.base_gpu_id, e.base_gpu_id + tp))
        assert e.base_gpu_id >= 0 and e.gpus[-1] < gpus  # within the node
    for r in plan.ranks:
        if r.component.kind in ("coordinator", "proxy"):
            assert r.device == "cpu" and r.engine is None
    own = {r.component.index: r.engine for r in trainers if r.engine is not None}
    for r in trainers:
        gpu = int(r.device.removeprefix("cuda:"))
        assert 0 <= gpu < gpus
        assert r.offload == (gpu in own[r.component.index].gpus)
        if mode == "disjoint":
            assert gpu not in engine_gpus and not r.offload
    assert plan.used == need


def _cell_engines_reference(
    ranks: int, nodes_per_cell: int, tp: int, nodes: int, per_cell: int
) -> dict[int, set[tuple[int, int]]]:
    """Each engine's (node, GPU) pairs, the obvious way for a colocated cell whose node holds
    one GPU per rank: engine j sits on the GPUs of its own ranks j*tp*nodes .. +tp*nodes."""
    per_node = ranks // nodes_per_cell
    span = tp * nodes
    return {j: {(s // per_node, s % per_node) for s in range(j * span, (j + 1) * span)}
            for j in range(per_cell)}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    nodes=st.sampled_from([1, 2, 3]),
    nodes_per_cell=st.sampled_from([1, 2, 3, 6]),
    engines=st.integers(1, 6),
    extra_gpus=st.integers(0, 3),
    mode=st.sampled_from(["colocated", "disjoint"]),
    data=st.data(),
)
def test_a_cells_engines_get_disjoint_gpus_on_the_nodes_that_hold_them(
    tp, nodes, nodes_per_cell, engines, extra_gpus, mode, data
) -> None:
    """Every engine of a cell (`engine.per_cell`, each `engine.nodes` nodes of `tensor_parallel`
    GPUs) on every node of the cell: engines never share a GPU, each spans at most `nodes`
    nodes with tensor_parallel GPUs on each, and colocated cells that fill their ranks use
    every GPU, each engine on its own ranks' GPUs (`_cell_engines_reference`)."""
    per_node = tp if nodes > 1 else tp * data.draw(st.integers(1, 3))
    ranks = per_node * nodes_per_cell
    if engines * tp * nodes > ranks:
        return
    gpus = per_node + extra_gpus + (engines * tp * nodes if mode == "disjoint" else 0)
    found: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for n in range(nodes_per_cell):
        comps = [cell(0, s) for s in range(n * per_node, (n + 1) * per_node)]
        comps = data.draw(st.permutations(comps))
        plan = plan_node(gpus, comps, tensor_parallel=tp, mode=mode, per_cell=engines,
                         nodes=nodes)  # fmt: skip
        trainer_gpus = [int(r.device.removeprefix("cuda:")) for r in plan.ranks]
        assert len(set(trainer_gpus)) == per_node and max(trainer_gpus) < gpus
        for r in plan.ranks:
            if r.engine is not None:
                assert r.engine.gpus == tuple(
                    range(r.engine.base_gpu_id, r.engine.base_gpu_id + tp)
                )
                assert r.engine.gpus[-1] < gpus
                found.setdefault(r.engine.engine, []).append((n, r.engine.gpus))
                if mode == "disjoint":
                    assert not set(r.engine.gpus) & set(trainer_gpus)
    assert sorted(found) == list(range(engines))
    pairs = [(n, g) for parts in found.values() for n, gs in parts for g in gs]
    assert len(set(pairs)) == len(pairs)  # no GPU serves two engines (or one twice)
    for parts in found.values():
        assert len(parts) == nodes and len({n for n, _ in parts}) == nodes
    if mode == "colocated":
        reference = _cell_engines_reference(ranks, nodes_per_cell, tp, nodes, engines)
        assert {
            j: {(n, g) for n, gs in parts for g in gs} for j, parts in found.items()
        } == reference
        if engines * tp * nodes == ranks:  # auto where it divides: every GPU serves
            assert set(pairs) == {(n, g) for n in range(nodes_per_cell) for g in range(per_node)}


def test_engine_hosts_and_node_ranks() -> None:
    assert engine_hosts(2, 8) == {0: (0, 0), 8: (1, 0)}
    assert engine_hosts(2, 8, nodes=2) == {0: (0, 0), 8: (0, 1), 16: (1, 0), 24: (1, 1)}
    plan = plan_node(8, [cell(0, s) for s in range(8, 16)], tensor_parallel=8,
                     mode="colocated", per_cell=2, nodes=2)  # fmt: skip
    assert plan[0].engine == EngineGpus(0, tuple(range(8)), engine=0, node_rank=1)


class FakeWorld:
    """A communicator of one node's ranks, seen from `rank` (Split_type / allgather / Free)."""

    def __init__(self, rank: int, env_local: list[int] | None = None) -> None:
        self.rank, self.env_local, self.freed = rank, env_local, 0

    def Get_rank(self) -> int:
        return self.rank

    def Split_type(self, kind: int, key: int) -> FakeWorld:
        assert kind == 7 and key == self.rank
        return self

    def allgather(self, item: tuple[int, int]) -> list[tuple[int, int]]:
        assert self.env_local is not None
        return [(lr, r) for r, lr in enumerate(self.env_local)]

    def Free(self) -> None:
        self.freed += 1


def test_local_rank_from_the_launcher_else_the_shared_memory_split() -> None:
    both = {"SLURM_LOCALID": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "LOCAL_RANK": "0"}
    assert local_rank(both) == 3
    assert local_rank({"MPI_LOCALRANKID": "2", "LOCAL_RANK": "5"}) == 2
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    world = FakeWorld(rank=5)
    assert local_rank({}, world, kind=7) == 5 and world.freed == 1
    with pytest.raises(ConfigError, match="SLURM_LOCALID='x'; allowed: a local rank >= 0"):
        local_rank({"SLURM_LOCALID": "x"})
    with pytest.raises(ConfigError, match="none of SLURM_LOCALID, MPI_LOCALRANKID"):
        local_rank({})


def test_node_ranks_are_ordered_by_local_rank() -> None:
    world = FakeWorld(rank=0, env_local=[2, 0, 1])
    assert node_ranks(world, {"SLURM_LOCALID": "2"}, kind=7) == [1, 2, 0]
    with pytest.raises(ConfigError, match=r"local ranks on this node are \[0, 0, 1\]"):
        node_ranks(FakeWorld(rank=0, env_local=[0, 1, 0]), {"LOCAL_RANK": "0"}, kind=7)


# ---- the colocated trainer's residency across role switches ----------------------------------


class FakeDevices:
    """A fake device map: each move copies the tensor and records (what, device)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.where: dict[int, str] = {}

    def __call__(self, what: str, t: torch.Tensor, device: str) -> torch.Tensor:
        self.calls.append((what, device))
        out = t.clone()
        self.where[out.data_ptr()] = device
        return out


def _core(seed: int = 0) -> tuple[TorchCell, CoreOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    cell_ = TorchCell(model.double(), objective=ObjectiveConfig())
    return cell_, CoreOptimizer(cell_, OptimConfig(lr=1e-2))


def _grad(cell_: TorchCell, k: int) -> torch.Tensor:
    return torch.randn(cell_.flat_params.shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(k))  # fmt: skip


def test_colocated_trainer_is_offloaded_on_every_switch_and_restored_on_its_device() -> None:
    plan = plan_node(4, [cell(0, 0), cell(0, 1)], tensor_parallel=2, mode="colocated")
    fake = FakeDevices()
    residency = TrainerResidency.for_rank(plan[1], move=fake)
    assert residency is not None and residency.device == "cuda:1"
    cell_, opt = _core()
    opt.step(_grad(cell_, 0))  # AdamW state exists
    to_host = [("flat_params", "cpu"), ("flat_grads", "cpu"),
               ("optimizer.exp_avg", "cpu"), ("optimizer.exp_avg_sq", "cpu")]  # fmt: skip
    back = [(what, "cuda:1") for what, _ in to_host]
    for _ in range(2):  # to_rollout, to_train, twice
        residency.release(cell_, opt)
        residency.restore(cell_, opt)
    assert fake.calls == (to_host + back) * 2
    residency.release(cell_, opt)
    state = opt.opt.state[opt._param]
    on = {fake.where.get(t.data_ptr()) for t in (cell_.flat_params, cell_.flat_grads,
                                                 state["exp_avg"], state["exp_avg_sq"])}  # fmt: skip
    assert on == {"cpu"}
    for p in cell_.model.parameters():  # the parameters are views of the moved buffers
        assert p.grad is not None
        assert (
            cell_.flat_params.data_ptr()
            <= p.data_ptr()
            < cell_.flat_params.data_ptr() + (cell_.flat_params.numel() * 8)
        )
        assert cell_.flat_grads.data_ptr() <= p.grad.data_ptr()
    with pytest.raises(TrainingError, match="already released"):
        residency.release(cell_, opt)
    residency.restore(cell_, opt)
    with pytest.raises(TrainingError, match="not released"):
        residency.restore(cell_, opt)


class MaskedOptimizer(CoreOptimizer):
    """Like `ModelParallelOptimizer`: a flat-sized device tensor of the optimizer's own."""

    def __init__(self, cell_: TorchCell, config: OptimConfig) -> None:
        super().__init__(cell_, config)
        self._mask = torch.ones_like(cell_.flat_params)


def test_the_optimizers_own_tensors_move_too() -> None:
    cell_, _ = _core()
    opt = MaskedOptimizer(cell_, OptimConfig())
    fake = FakeDevices()
    residency = TrainerResidency(device="cuda:3", move=fake)
    residency.release(cell_, opt)
    assert fake.calls == [("flat_params", "cpu"), ("flat_grads", "cpu"), ("optimizer._mask", "cpu")]
    assert fake.where[opt._mask.data_ptr()] == "cpu"
    assert opt._param.data_ptr() == cell_.flat_params.data_ptr()


def test_trainer_on_its_own_gpu_needs_no_residency() -> None:
    plan = plan_node(4, [cell(0, 0), cell(0, 1)], tensor_parallel=1, mode="colocated")
    assert TrainerResidency.for_rank(plan[0]) is not None  # shares cuda:0 with the engine
    assert TrainerResidency.for_rank(plan[1]) is None  # cuda:1 is its own
    disjoint = plan_node(4, [cell(0, 0), cell(0, 1)], tensor_parallel=2, mode="disjoint")
    assert all(TrainerResidency.for_rank(r) is None for r in disjoint.ranks)


def test_training_after_release_and_restore_equals_a_cell_never_released() -> None:
    cell_, opt = _core()
    ref_cell, ref_opt = _core()
    residency = TrainerResidency(device="cuda:0", move=FakeDevices())
    for k in range(3):
        opt.step(_grad(cell_, k))
        ref_opt.step(_grad(ref_cell, k))
        cell_.flat_grads.fill_(float(k))
        ref_cell.flat_grads.fill_(float(k))
        residency.release(cell_, opt)
        residency.restore(cell_, opt)
    assert torch.equal(cell_.flat_params, ref_cell.flat_params)
    assert torch.equal(cell_.flat_grads, ref_cell.flat_grads)  # accumulated grads kept
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(cell_.model(x), ref_cell.model(x))  # the model computes with them


class GatherWorld:
    """A world seen from `rank` whose allgather returns `offers` with this rank's own offer."""

    def __init__(self, rank: int, offers: list[str | None]) -> None:
        self.rank, self.offers = rank, offers

    def Get_rank(self) -> int:
        return self.rank

    def allgather(self, value: str | None) -> list[str | None]:
        self.offers[self.rank] = value
        return list(self.offers)


def test_each_node_rank_of_a_multi_node_engine_meets_at_its_node_rank_0() -> None:
    """`rendezvous`: node rank 0's host offers its address and a free port; the rank that
    launches node rank 1 of the same engine (tensor_parallel ranks further on) gets exactly
    that, other ranks nothing; on one node no collective runs at all."""
    from types import SimpleNamespace

    from gyre.runtime.roles import rendezvous

    tp, comps = 2, [COORD, PROXY] + [cell(0, s) for s in range(8)]
    cfg = SimpleNamespace(engine=SimpleNamespace(nodes=2, tensor_parallel=tp))
    hosts = engine_hosts(2, tp, nodes=2)  # shards 0, 2 (engine 0), 4, 6 (engine 1)
    offers: list[str | None] = [None] * len(comps)
    got = {}
    for rank, c in enumerate(comps):
        j, k = hosts.get(c.shard, (0, 0)) if c.kind == "cell" else (0, 0)
        launches = c.kind == "cell" and c.shard in hosts
        placed = RankDevice(0, c, "cuda:0", EngineGpus(0, (0, 1), j, k) if launches else None)
        got[rank] = rendezvous(cfg, GatherWorld(rank, offers), comps, "127.0.0.1", placed)  # type: ignore[arg-type]
    first0, first1 = got[2], got[6]  # shards 0 and 4: node rank 0 of engines 0 and 1
    assert first0.startswith("127.0.0.1:") and first1.startswith("127.0.0.1:")
    assert got[4] == first0 and got[8] == first1  # shards 2 and 6: their node rank 1
    assert [got[r] for r in (0, 1, 3, 5, 7, 9)] == [""] * 6
    single = SimpleNamespace(engine=SimpleNamespace(nodes=1, tensor_parallel=tp))
    assert rendezvous(single, None, comps, "127.0.0.1", RankDevice(0, cell(0, 0), "cuda:0")) == ""  # type: ignore[arg-type]
