"""How a task finds its component from SLURM_PROCID and SLURM_NTASKS_HET_GROUP_<n>."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.launch.task import het_group_sizes, locate, restart_count
from gyre.runtime.shared.layout import Component, Layout, TopologyConfig


def reference_locate(procid: int, sizes: list[int]) -> tuple[int, int]:
    """Slow obvious reference: list every task's (group, rank in group) in order."""
    tasks = [(g, r) for g, n in enumerate(sizes) for r in range(n)]
    return tasks[procid]


@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.data())
def test_locate_matches_reference(sizes: list[int], data: st.DataObject) -> None:
    procid = data.draw(st.integers(0, sum(sizes) - 1))
    assert locate(procid, sizes) == reference_locate(procid, sizes)


def test_locate_rejects_out_of_range() -> None:
    with pytest.raises(ConfigError, match="below the step's 3 tasks"):
        locate(3, [1, 1, 1])


def test_group_sizes_from_env() -> None:
    env = {f"SLURM_NTASKS_HET_GROUP_{i}": str(n) for i, n in enumerate([1, 1, 4, 4, 2])}
    assert het_group_sizes(env) == [1, 1, 4, 4, 2]
    assert het_group_sizes({"SLURM_NTASKS": "4"}) is None
    assert restart_count({}) == 0 and restart_count({"SLURM_RESTART_COUNT": "2"}) == 2


def test_a_slurm_task_runs_its_groups_component() -> None:
    """Slurm numbers the het groups in the layout's order: coordinator, proxy, the cells,
    the standalone pool; a task's (group, rank in group) names what it runs."""
    topology = TopologyConfig(cells=2, ranks_per_cell=4, standalone_engines=2)
    at = Layout(topology).component_at
    got = [at(g, r) for g, r in [(0, 0), (1, 0), (2, 3), (3, 0), (4, 1)]]
    assert got == [
        Component("coordinator"),
        Component("proxy"),
        Component("cell", 0, 3),
        Component("cell", 1, 0),
        Component("standalone", 1),
    ]
    # the same as the world's components, rank by rank
    sizes = [g.size for g in Layout(topology).groups]
    flat = [at(*locate(rank, sizes)) for rank in range(sum(sizes))]
    assert flat == Layout(topology).components
