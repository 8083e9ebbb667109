"""From a run config to the heterogeneous job: components, layout checks, cluster checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.launch.cluster import Cluster, Partition, parse_cluster, validate
from gyre.launch.config import time_minutes
from gyre.launch.spec import job_spec, load_launch
from gyre.runtime.preflight import Where

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "templates" / "cluster"


def variant(tmp_path: Path, base: str, **changes: Any) -> Path:
    """A copy of a template with `section.key` values changed."""
    data = yaml.safe_load((CLUSTER / base).read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data.setdefault(section, {})[key] = value
    path = tmp_path / f"variant-{base}"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("name", "cells", "nodes_per_cell", "total"),
    [("nl2repo-32.yaml", 8, 4, 34), ("swe-24.yaml", 6, 4, 26), ("nl2repo-192.yaml", 4, 47, 190)],
)
def test_paper_templates_shape(name: str, cells: int, nodes_per_cell: int, total: int) -> None:
    spec = job_spec(load_launch(CLUSTER / name))
    roles = [c.role for c in spec.components]
    assert roles == ["coordinator", "proxy"] + ["cell"] * cells
    assert [c.nodes for c in spec.components[2:]] == [nodes_per_cell] * cells
    assert all(c.ntasks_per_node == 8 and c.gpus_per_node == 8 for c in spec.components[2:])
    assert spec.total_nodes == total
    assert spec.world_size == 2 + cells * nodes_per_cell * 8


@pytest.mark.parametrize(
    ("name", "shape", "nodes_per_cell", "engines"),
    [("qwen3-8b", "qwen3-8b", 1, 1), ("qwen3-30b-a3b", "qwen3-30b-a3b", 2, 2),
     ("nl2repo-32", "qwen3-30b-a3b", 4, 4), ("swe-24", "qwen3-30b-a3b", 4, 4),
     ("nl2repo-192", "qwen3-235b-a22b", 47, 47)],
)  # fmt: skip
def test_gpu_templates_fit_their_memory_plan_and_serve_on_every_gpu(
    name: str, shape: str, nodes_per_cell: int, engines: int
) -> None:
    """The GPU templates train with Megatron in a layout the memory plan accepts on 80 GB
    GPUs, for their model's shape (`templates/shapes/`: the paper-shaped ones a documented
    stand-in), every rank and the engine; each cell's engines hold all its GPUs, so `gyre
    render` warns of no GPU idle during rollout."""
    from gyre.runtime.shared.config import load_run_config
    from gyre.runtime.shared.memory import memory_plan

    cfg = load_run_config(
        CLUSTER / f"{name}.yaml", [f"model={ROOT / 'templates' / 'shapes' / shape}"]
    )
    plan = memory_plan(cfg)
    assert plan.gpu and plan.limit == 80e9 and plan.layout.backend == "megatron"
    assert plan.layout.sequence and plan.layout.dtype == "bfloat16"
    assert plan.rank_problem() is None and plan.engine_problem() is None
    assert plan.layout.window == cfg.scheduler()[0].window  # planned as the scheduler claims
    assert cfg.engines_per_cell == engines
    spec = job_spec(load_launch(CLUSTER / f"{name}.yaml"))
    assert {c.nodes for c in spec.components if c.role == "cell"} == {nodes_per_cell}
    assert not any("idle" in line for line in spec.footprint()), spec.footprint()


def test_render_warns_when_gpus_idle_during_rollout(tmp_path: Path) -> None:
    """A cell whose engines leave GPUs without an engine: `gyre render` names how many wait
    out every rollout phase, and what fills them."""
    one = job_spec(load_launch(variant(tmp_path, "qwen3-30b-a3b.yaml", engine__per_cell=1)))
    assert one.footprint()[2] == (
        "warning: each cell's 16 GPUs serve rollout from one engine on 8 GPUs each "
        "(engine.tensor_parallel x engine.nodes): 8 (50%) idle while it serves "
        "(engine.per_cell auto fills a colocated cell)"
    )
    tp4 = variant(tmp_path, "nl2repo-32.yaml", engine__tensor_parallel=4, engine__expert_parallel=4,
                  engine__per_cell=3)  # fmt: skip
    assert (
        "from 3 engines on 4 GPUs each (engine.tensor_parallel x engine.nodes): 20 (62%) idle"
        in (job_spec(load_launch(tp4)).footprint()[3])
    )


def test_local_template_is_five_single_task_components() -> None:
    spec = job_spec(load_launch(ROOT / "templates" / "local.yaml"))
    assert [(c.role, c.nodes, c.ntasks) for c in spec.components] == [
        ("coordinator", 1, 1),
        ("proxy", 1, 1),
        ("cell", 1, 1),
        ("cell", 1, 1),
        ("cell", 1, 1),
    ]


def test_render_states_the_footprint_and_warns_on_an_overloaded_proxy(tmp_path: Path) -> None:
    spec = job_spec(load_launch(CLUSTER / "nl2repo-192.yaml"))
    # 4 cells x 47 nodes x 8 GPUs; the coordinator and proxy nodes have none; 3 days
    assert spec.footprint()[0] == (
        "190 nodes, 1504 GPUs, 1506 ranks; 108288 GPU-hours and 13680 node-hours at the time "
        "limit 3-00:00:00"
    )
    lines = spec.footprint()
    # the cells' backends, their parallel layout and engines (every node of a cell serves)
    assert lines[1] == ("cells: train megatron (tensor 4 x pipeline 47 x data 2 per cell), "
                        "engine sglang (TP 8, 47 per cell)")  # fmt: skip
    # 4 cells x 94 harnesses on a proxy of 96 CPUs
    assert "up to 376 harnesses run at once on the proxy node, which has 96 CPUs" in lines[2]
    # the suite on the cluster's file system is not checked from here; no GPU idles
    assert len(lines) == 4 and "not checked here: harness.suite /shared/" in lines[3], lines
    long_rows = variant(tmp_path, "nl2repo-192.yaml", proxy__max_context_tokens=262144,
                        train__token_budget=16384)  # fmt: skip
    lines = job_spec(load_launch(long_rows)).footprint()
    # 256k-token contexts, a 16k micro-step budget: the longest paths train alone
    assert "proxy.max_context_tokens 262144 > train.token_budget 16384" in lines[3]
    roomy = variant(tmp_path, "nl2repo-192.yaml", slurm__proxy={"cpus_per_task": 384},
                    slurm__time_limit="12:00:00")  # fmt: skip
    lines = job_spec(load_launch(roomy)).footprint()
    assert lines[0] == ("190 nodes, 1504 GPUs, 1506 ranks; 18048 GPU-hours and 2280 node-hours "
                        "at the time limit 12:00:00")  # fmt: skip
    assert len(lines) == 3 and "not checked here: harness.suite /shared/" in lines[2], lines


def test_cell_layout_must_divide_nodes(tmp_path: Path) -> None:
    path = variant(tmp_path, "swe-24.yaml", topology__ranks_per_cell=30,
                   train__parallel={"tensor": 2, "pipeline": 3, "data": 5, "expert": 1})  # fmt: skip
    with pytest.raises(ConfigError) as e:
        job_spec(load_launch(path))
    msg = str(e.value)
    assert "slurm.nodes_per_cell: 4 does not divide topology.ranks_per_cell (30)" in msg
    assert "allowed: a divisor of 30" in msg


def test_standalone_pool_needs_nodes_and_even_spread(tmp_path: Path) -> None:
    path = variant(tmp_path, "swe-24.yaml", topology__standalone_engines=4)
    with pytest.raises(ConfigError, match=r"slurm\.standalone_nodes: 0 but"):
        job_spec(load_launch(path))
    data = yaml.safe_load(path.read_text())
    data["slurm"]["standalone_nodes"] = 2  # two TP-8 engines on a node of 8 GPUs: no room
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"slurm\.gpus_per_node 8: .* 2 engines with "
                       r"tensor_parallel 8 needs 16"):  # fmt: skip
        load_launch(path)
    data["slurm"]["standalone_nodes"] = 4
    path.write_text(yaml.safe_dump(data))
    spec = job_spec(load_launch(path))
    pool = spec.components[-1]
    assert (pool.role, pool.nodes, pool.ntasks) == ("standalone", 4, 4)


@pytest.mark.parametrize(("change", "message"), [
    ({"slurm__gpus_per_node": 0}, r"slurm\.gpus_per_node: 0, but engine\.backend sglang "
                                  r"\(tensor_parallel 8\) runs on GPUs"),
    ({"slurm__gpus_per_node": 4}, r"slurm\.gpus_per_node 4: this node has 4 GPUs but .*needs 8"),
    ({"harness__adapter": "nope"}, r"harness\.adapter.*'nope'"),
    ({"harness__params": {"bogus": "1"}}, r"harness\.params"),
    ({"harness__suite": "learn", "harness__tasks": ["nope"]},
     r"harness\.tasks: \['nope'\] not in suite 'learn'"),
])  # fmt: skip
def test_render_submit_and_the_job_refuse_what_the_job_could_not_run(
    tmp_path: Path, change: dict, message: str
) -> None:
    """The preflight `gyre run` runs, on every way a cluster job starts (render, render
    --check, submit, the in-job check): refused before anything is queued."""
    here = {
        "harness__suite": "learn",
        "harness__tasks": ["notes"],
        "harness__adapter": "reference",
        "harness__params": {},
    }  # a suite and a harness this machine has
    path = variant(tmp_path, "swe-24.yaml", **{**here, **change})
    for where in Where:
        if where is Where.HERE:
            continue
        with pytest.raises(ConfigError, match=message):
            load_launch(path, where=where)


def test_unknown_key_is_rejected_before_anything(tmp_path: Path) -> None:
    path = variant(tmp_path, "swe-24.yaml", slurm__partitoin="gpu")
    with pytest.raises(ConfigError, match=r"run\.slurm: unknown key 'partitoin'"):
        load_launch(path)


GPU = Partition(name="gpu", nodes=30, max_time_min=4 * 1440, cpus_per_node=128, gpus_per_node=8)
CPU = Partition(name="cpu", nodes=4, cpus_per_node=16, default=True)


def test_validate_accepts_fitting_job() -> None:
    validate(job_spec(load_launch(CLUSTER / "swe-24.yaml")), Cluster(partitions={"gpu": GPU}))


def test_validate_too_many_nodes() -> None:
    spec = job_spec(load_launch(CLUSTER / "nl2repo-32.yaml"))
    with pytest.raises(ConfigError) as e:
        validate(spec, Cluster(partitions={"gpu": GPU}))
    assert "asks for 34 nodes in partition 'gpu'" in str(e.value)
    assert "which has 30" in str(e.value)


def test_validate_missing_partition(tmp_path: Path) -> None:
    spec = job_spec(load_launch(variant(tmp_path, "swe-24.yaml", slurm__partition="h100")))
    with pytest.raises(ConfigError) as e:
        validate(spec, Cluster(partitions={"gpu": GPU, "cpu": CPU}))
    assert "asks for 'h100', which this cluster does not have" in str(e.value)
    assert "allowed partitions: cpu, gpu" in str(e.value)


def test_validate_gpus_cpus_and_time(tmp_path: Path) -> None:
    small = Partition(name="gpu", nodes=30, cpus_per_node=64, gpus_per_node=4)
    spec = job_spec(load_launch(CLUSTER / "swe-24.yaml"))
    with pytest.raises(ConfigError, match="needs 96 CPUs per node"):
        validate(spec, Cluster(partitions={"gpu": small}))
    small.cpus_per_node = 128
    with pytest.raises(ConfigError, match="asks for 8 GPUs per node"):
        validate(spec, Cluster(partitions={"gpu": small}))
    short = Partition(name="gpu", nodes=30, max_time_min=60, cpus_per_node=128, gpus_per_node=8)
    with pytest.raises(
        ConfigError, match="exceeds the MaxTime of partition 'gpu' \\(60 minutes\\)"
    ):
        validate(spec, Cluster(partitions={"gpu": short}))


def test_parse_cluster_from_scontrol_text() -> None:
    parts = (
        "PartitionName=gpu Default=NO MaxNodes=UNLIMITED MaxTime=2-00:00:00 State=UP "
        "TotalNodes=200\nPartitionName=debug Default=YES MaxNodes=2 MaxTime=30 State=UP "
        "TotalNodes=4\n"
    )
    nodes = (
        "NodeName=c1 CPUTot=128 Gres=gpu:h100:8(S:0-1) Partitions=gpu\n"
        "NodeName=d1 CPUTot=16 Gres=(null) Partitions=debug,gpu\n"
    )
    cluster = parse_cluster(parts, nodes)
    gpu, debug = cluster.partitions["gpu"], cluster.partitions["debug"]
    assert (gpu.nodes, gpu.max_time_min, gpu.cpus_per_node, gpu.gpus_per_node) == (
        200,
        2880,
        128,
        8,
    )
    assert (debug.max_nodes, debug.max_time_min, debug.default) == (2, 30, True)
    assert cluster.resolve(None) is debug


def reference_minutes(d: int, h: int, m: int, s: int) -> int:
    total_s = ((d * 24 + h) * 60 + m) * 60 + s
    return -(-total_s // 60)


@given(st.integers(0, 30), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59))
def test_time_minutes_matches_reference(d: int, h: int, m: int, s: int) -> None:
    assert time_minutes(f"{d}-{h:02d}:{m:02d}:{s:02d}") == reference_minutes(d, h, m, s)
    assert time_minutes(f"{d * 24 + h}:{m:02d}:{s:02d}") == reference_minutes(d, h, m, s)
    assert time_minutes(f"{m}:{s:02d}") == reference_minutes(0, 0, m, s)
    assert time_minutes(f"{m}") == m
