"""One preflight for every way a run starts: what a run config must pass before any process
of its job starts.

`gyre run` (`Where.HERE`: this machine runs the job), `gyre render` (`Where.ANYWHERE`: a
script is written, maybe far from the cluster), `gyre render --check` and `gyre submit`
(`Where.CLUSTER`: on the cluster's login node) and the job's own first step, `python -m
gyre.launch.check` (`Where.CLUSTER`, inside the allocation), all call `preflight`, so a
config one of them passes is one the others pass too and the job does not fail after
waiting in the queue. What it checks:

* harness: the adapter is known and its `params` valid; the suite loads and names every task
  of `harness.tasks` (a suite path missing here is a note from `render`, an error from the
  others); the adapter's program is installed (`HERE`, `CLUSTER`); the sandbox works (`HERE`;
  on a cluster the proxy node checks it as it starts);
* backends against devices: on a cluster, every cell node and standalone node places its
  ranks and engine on `slurm.gpus_per_node` GPUs (`gyre.runtime.placement.plan_node`, the
  plan each rank makes at start); here, the model and what this machine can run
  (`RunConfig.check_machine`, the rank count `gyre run` starts).

Returns the notes to print (the config's warnings, what could not be checked where it runs).
"""

from __future__ import annotations

import enum
import os
from typing import TYPE_CHECKING

from gyre.errors import ConfigError
from gyre.runtime.layout import Component
from gyre.runtime.placement import plan_node

if TYPE_CHECKING:
    from gyre.runtime.config import RunConfig


class Where(enum.Enum):
    HERE = "here"
    """`gyre run`: this machine starts every rank."""
    ANYWHERE = "anywhere"
    """`gyre render`: only what holds wherever the script is written."""
    CLUSTER = "cluster"
    """`gyre render --check`, `gyre submit`, the job's first step: the cluster's view."""


RANKS_PER_CPU = 8
"""`gyre run` starts every rank on this machine: at most this many per CPU (the default job
runs 5 ranks + 3 engine processes on 2 CPUs, 2-rank cells 8 + 3)."""


def preflight(cfg: RunConfig, where: Where, *, gpus_per_node: int | None = None,
              nodes_per_cell: int = 1, standalone_nodes: int = 0) -> list[str]:  # fmt: skip
    """Raise `ConfigError` (one line: what is wrong, what is allowed) at the first problem;
    return the notes. `gpus_per_node` and the node counts are the Slurm request (cluster)."""
    notes = list(cfg.warnings())
    if where is Where.HERE:
        _fits_this_machine(cfg)  # first: a cluster config is told to go to the cluster
    notes += _harness(cfg, where)
    if where is Where.HERE:
        from gyre.models import check_model

        check_model(cfg.model)
        cfg.check_machine()
    elif gpus_per_node is not None:
        check_gpus(cfg, gpus_per_node, nodes_per_cell, standalone_nodes)
    return notes


def _harness(cfg: RunConfig, where: Where) -> list[str]:
    from gyre.runtime.proxy_node import check_adapter, check_sandbox, load_tasks

    check_adapter(cfg, program=where is not Where.ANYWHERE)
    if where is Where.HERE:
        check_sandbox(cfg.harness.sandbox, cfg.harness.apptainer_image)
    try:
        load_tasks(cfg)
    except ConfigError as e:
        if where is Where.ANYWHERE and _suite_elsewhere(cfg.harness.suite):
            return [f"not checked here: harness.suite {cfg.harness.suite} (not on this machine; "
                    "gyre render --check, gyre submit and the job's first step check it)"]  # fmt: skip
        if str(e).startswith("harness."):  # harness.tasks: names not in the suite
            raise
        raise ConfigError(f"harness.suite: {e}; point it at your task suite (docs/tasks.md), "
                          "e.g. harness.suite=/path/to/suite") from None  # fmt: skip
    return []


def _suite_elsewhere(suite: str | list[str]) -> bool:
    """A suite (or one of a list) given as a path that does not exist here (a cluster's
    shared file system)."""
    return any(
        os.sep in s and not os.path.exists(s)
        for s in ([suite] if isinstance(suite, str) else suite)
    )


def uses_gpus(cfg: RunConfig) -> bool:
    """Does the run place anything on a GPU (an SGLang engine, a CUDA trainer)?"""
    return cfg.train.device.startswith("cuda") or cfg.engine.backend == "sglang"


def check_gpus(cfg: RunConfig, gpus: int, nodes_per_cell: int, standalone_nodes: int) -> None:
    """Every node of the job places its ranks and engine on `gpus` GPUs, as the ranks will."""
    if not uses_gpus(cfg):
        return
    why = (f"engine.backend sglang (tensor_parallel {cfg.engine.tensor_parallel})"
           if cfg.engine.backend == "sglang" else f"train.device {cfg.train.device}")  # fmt: skip
    if gpus == 0:
        raise ConfigError(f"slurm.gpus_per_node: 0, but {why} runs on GPUs; allowed: the GPUs "
                          "of each cell node (>= 1), or engine.backend=embedded with "
                          "train.device=cpu on a CPU cluster")  # fmt: skip
    t = cfg.topology
    if nodes_per_cell < 1 or t.ranks_per_cell % nodes_per_cell:
        return  # the layout's own check names it (gyre.launch.spec.job_spec)
    per_node = t.ranks_per_cell // nodes_per_cell
    nodes = [[Component("cell", 0, shard) for shard in range(k * per_node, (k + 1) * per_node)]
             for k in range(nodes_per_cell)]  # fmt: skip
    if t.standalone_engines and (standalone_nodes < 1 or t.standalone_engines % standalone_nodes):
        return  # the layout's own check names it (gyre.launch.spec.job_spec)
    if t.standalone_engines:
        each = t.standalone_engines // standalone_nodes
        nodes.append([Component("standalone", i) for i in range(each)])
    for ranks in nodes:
        try:
            plan_node(gpus, ranks, tensor_parallel=cfg.engine.tensor_parallel,
                      mode=cfg.topology.placement)  # fmt: skip
        except ConfigError as e:
            raise ConfigError(f"slurm.gpus_per_node {gpus}: {e} ({why})") from None


def _fits_this_machine(cfg: RunConfig) -> None:
    """Refuse a world `gyre run` cannot start here (a cluster template)."""
    t = cfg.topology
    cpus = os.cpu_count() or 1
    if t.world_size > RANKS_PER_CPU * cpus:
        raise ConfigError(
            f"topology: {t.world_size} ranks (1 coordinator + 1 proxy + {t.cells} cells x "
            f"{t.ranks_per_cell} ranks + {t.standalone_engines} standalone engines); gyre run "
            f"starts them all on this machine, which has {cpus} CPUs; allowed: at most "
            f"{RANKS_PER_CPU * cpus} ranks here. Run a cluster config with `gyre submit "
            "CONFIG` or `gyre render CONFIG -o job.sbatch && sbatch job.sbatch`, or shrink it "
            "(topology.cells=3 topology.ranks_per_cell=1)"
        )
