"""SlurmConfig validation: every bad value is rejected naming the field and what is allowed."""

from __future__ import annotations

import pytest

from gyre.config import load
from gyre.errors import ConfigError
from gyre.launch.config import NodeSpec, SlurmConfig


def test_defaults_and_yaml_shape_load() -> None:
    cfg = load(
        SlurmConfig,
        {
            "partition": "gpu",
            "time_limit": "2-00:00:00",
            "nodes_per_cell": 4,
            "gpus_per_node": 8,
            "coordinator": {"cpus_per_task": 8, "partition": "cpu"},
            "extra_sbatch": ["--mail-type=END"],
            "env": {"NCCL_DEBUG": "WARN"},
        },
        path="slurm",
    )
    assert cfg.coordinator == NodeSpec(cpus_per_task=8, partition="cpu")
    assert cfg.mpi == "pmi2" and cfg.requeue and cfg.signal_seconds == 300


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"mpi": "openmpi"}, "slurm.mpi: 'openmpi' is not allowed; choose one of 'pmi2', 'pmix'"),
        ({"time_limit": "2h"}, "slurm.time_limit: '2h'; allowed Slurm time formats"),
        ({"nodes_per_cell": 0}, "slurm.nodes_per_cell: 0; allowed an integer >= 1"),
        ({"gpus_per_node": -1}, "slurm.gpus_per_node: -1"),
        ({"partition": "gpu nodes"}, "slurm.partition: 'gpu nodes'; allowed: a Slurm name"),
        ({"mem": "lots"}, "slurm.mem: 'lots'"),
        ({"signal_seconds": 70000}, "slurm.signal_seconds: 70000; allowed 0..65535"),
        ({"extra_sbatch": ["--nodes=3"]}, "slurm.extra_sbatch[0]: --nodes is set by Gyre"),
        ({"extra_sbatch": ["#SBATCH --x"]}, "slurm.extra_sbatch[0]"),
        ({"log_dir": "logs/%j"}, "slurm.log_dir"),
        ({"env": {"1BAD": "x"}}, "env: '1BAD' is not a shell variable name"),
        ({"coordinator": {"cpus_per_task": 0}}, "slurm.coordinator.cpus_per_task: 0"),
        ({"nodes": 3}, "slurm: unknown key 'nodes'; allowed keys:"),
    ],
)
def test_bad_values_name_the_field(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(SlurmConfig, data, path="slurm")
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "t", ["30", "30:00", "1:00:00", "2-0", "2-12:30", "7-00:00:00", "infinite"]
)
def test_slurm_time_formats_accepted(t: str) -> None:
    assert SlurmConfig(time_limit=t).time_limit == t
