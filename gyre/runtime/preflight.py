"""One preflight for every way a run starts: what a run config must pass before any process
of its job starts.

`gyre run` (`Where.HERE`: this machine runs the job), `gyre render` (`Where.ANYWHERE`: a
script is written, maybe far from the cluster), `gyre render --check` and `gyre submit`
(`Where.CLUSTER`: the cluster's login node) and the job's own first step, `python -m
gyre.launch.check` (`Where.JOB`: inside the allocation), all call `preflight`, so a config
one of them passes is one the others pass too and the job does not fail after waiting in the
queue. Each check belongs to its domain and is the one the ranks run (or run into); here they
are only called:

* harness: the adapter is known and its `params` declared and of their types
  (`Adapter.check_params`); the suite loads and names every task of `harness.tasks` (a suite
  path missing here is a note from `render`, an error from the others); the adapter's program
  is installed (an error where the job runs, `HERE` and `JOB`; a note on the login node, not
  checked by `render`); the sandbox works (`HERE`; on a cluster the proxy node checks it as it
  starts);
* the model (`gyre.models`): it loads (a directory missing here is a note on the login node,
  not checked by `render`), its vocab covers its tokenizer, the embedded engine can batch its
  KV cache, and the Megatron backend can lay it out (`gyre.train.megatron.config.
  check_trainable`, what the cell ranks compute);
* backends against devices: here, what this machine can run (`RunConfig.check_machine`) and
  the plan on its own CUDA devices; on a cluster, every cell node and standalone node places
  its ranks and engine on `slurm.gpus_per_node` GPUs (`check_gpus`: `plan_node`, the plan
  each rank makes at start) — with the login node's Slurm log folder, called by the launch
  layer (`gyre.launch.spec.load_launch`), which owns the Slurm section;
* the experiment trackers (`gyre.tracking.check`);
* the run directory: it can be written, and a run already in it can be continued with this
  config (`gyre.runtime.coordinator.resume.check_run_dir`: `--resume`, `--run-dir` of an existing run, a
  requeued job's `GYRE_RUN_DIR`).

Returns the notes to print (the config's warnings, what could not be checked where it runs).
"""

from __future__ import annotations

import argparse
import enum
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gyre import fsafe
from gyre.errors import ConfigError
from gyre.runtime.shared.layout import Component, Layout
from gyre.runtime.shared.placement import plan_node

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig


class Where(enum.Enum):
    HERE = "here"
    """`gyre run`: this machine starts every rank."""
    ANYWHERE = "anywhere"
    """`gyre render`: only what holds wherever the script is written."""
    CLUSTER = "cluster"
    """`gyre render --check`, `gyre submit`: the cluster's login node (its shared file system
    and Slurm; programs and models may live on the compute nodes only)."""
    JOB = "job"
    """The job's first step (`python -m gyre.launch.check`), inside the allocation."""


RUNS_HERE = (Where.HERE, Where.JOB)
"""Where the job itself runs: what it needs must be here."""

RANKS_PER_CPU = 8
"""`gyre run` starts every rank on this machine: at most this many per CPU (the default job
runs 5 ranks + 3 engine processes on 2 CPUs, 2-rank cells 8 + 3)."""


def preflight(cfg: RunConfig, where: Where, *, run_dir: Path | None = None,
              resume: bool = False, config: Path | None = None) -> list[str]:  # fmt: skip
    """Raise `ConfigError` (one line: what is wrong, what is allowed) at the first problem;
    return the notes. `run_dir`: the run directory the job will use (`gyre run`, the job's
    `GYRE_RUN_DIR`); `resume`: it is continued with the run's own config plus overrides;
    `config`: the config file a new run was started from (the run directory stays apart)."""
    notes = list(cfg.warnings())
    if where is Where.HERE:
        _fits_this_machine(cfg)  # first: a cluster config is told to go to the cluster
    notes += _harness(cfg, where)
    if where is Where.HERE:
        cfg.check_machine()
        _devices_here(cfg)
    notes += _model(cfg, where)
    from gyre.tracking import check as check_tracking

    check_tracking(cfg.tracking, installed=where in RUNS_HERE)
    if run_dir is not None:
        _run_dir(cfg, run_dir, where, resume, config)
    elif where is Where.CLUSTER:  # the job makes runs_dir/<name>-<job id> from here
        _writable(Path(cfg.runs_dir), "runs_dir", "runs_dir=DIR")
    return notes


def _harness(cfg: RunConfig, where: Where) -> list[str]:
    from gyre.runtime.proxy_node.node import check_adapter, check_sandbox, load_tasks

    notes = []
    if where in RUNS_HERE:
        check_adapter(cfg, program=True)
    else:  # the program may be installed on the compute nodes only
        check_adapter(cfg, program=False)
        try:
            check_adapter(cfg, program=True)
        except ConfigError as e:
            if where is Where.CLUSTER:
                notes.append(f"not checked here: {e} (the job's first step checks it)")
    if where is Where.HERE:
        check_sandbox(cfg.harness.sandbox, cfg.harness.apptainer_image)
    try:
        load_tasks(cfg)
    except ConfigError as e:
        if where is Where.ANYWHERE and _elsewhere(cfg.harness.suite):
            return [*notes, f"not checked here: harness.suite {cfg.harness.suite} (not on "
                    "this machine; gyre render --check, gyre submit and the job's first step "
                    "check it)"]  # fmt: skip
        if str(e).startswith("harness."):  # harness.tasks: names not in the suite
            raise
        raise ConfigError(f"harness.suite: {e}; point it at your task suite (docs/tasks.md), "
                          "e.g. harness.suite=/path/to/suite") from None  # fmt: skip
    return notes


def _elsewhere(paths: str | list[str]) -> bool:
    """A path (or one of a list) that does not exist here (a cluster's shared file system)."""
    return any(
        os.sep in s and not os.path.exists(s)
        for s in ([paths] if isinstance(paths, str) else paths)
    )


def _model(cfg: RunConfig, where: Where) -> list[str]:
    """The model loads, its vocab covers its tokenizer, the embedded engine can batch it and
    the training backend can train it (no weights read)."""
    from gyre.models import check_batchable, check_model, check_tokenizer, model_config, tiny_size

    model = cfg.model
    try:
        check_model(model)
    except ConfigError:
        if where in RUNS_HERE or not (_elsewhere(model) or model == "smollm2-135m"):
            raise
        if where is Where.ANYWHERE:  # a script is written, maybe far from the cluster
            return []
        return [f"not checked here: model {model} (not on this machine; the job's first step "
                "checks it)"]  # fmt: skip
    shipped = tiny_size(model) is not None or model == "smollm2-135m"  # Qwen2 / Llama
    if shipped and cfg.train.backend != "megatron":
        return []
    config = model_config(model)
    if config is None:
        return []
    if not shipped:
        check_tokenizer(model, config)
    if cfg.train.backend == "megatron":
        from gyre.train.megatron.config import MegatronConfig, check_trainable

        dims = cfg.dims
        try:
            check_trainable(config.to_dict(), MegatronConfig(tensor_parallel=dims.tensor,
                                                             pipeline_parallel=dims.pipeline))  # fmt: skip
        except ConfigError as e:
            raise ConfigError(f"model: {model!r} with train.backend megatron: {e} (or "
                              "train.backend=torch)") from None  # fmt: skip
    if not shipped and cfg.engine.backend == "embedded":
        check_batchable(model, config)
    return []


def uses_gpus(cfg: RunConfig) -> bool:
    """Does the run place anything on a GPU (an SGLang engine, a CUDA trainer)?"""
    return cfg.train.device.startswith("cuda") or cfg.engine.backend == "sglang"


def check_gpus(cfg: RunConfig, gpus: int, nodes_per_cell: int, standalone_nodes: int) -> None:
    """Every node of the job places its ranks and engine on `gpus` GPUs, as the ranks will."""
    if not uses_gpus(cfg):
        return
    why = _why_gpus(cfg)
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


def _why_gpus(cfg: RunConfig) -> str:
    if cfg.engine.backend == "sglang":
        return f"engine.backend sglang (tensor_parallel {cfg.engine.tensor_parallel})"
    return f"train.device {cfg.train.device}"


def _devices_here(cfg: RunConfig) -> None:
    """This machine's CUDA devices place every rank and engine of the job, as each rank's
    `place_rank` will (`torch.cuda.device_count()`, then `plan_node` over the whole world)."""
    if not uses_gpus(cfg):
        return
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:  # an SGLang engine without CUDA is refused by `check_machine` first
        raise ConfigError(f"train.device: {cfg.train.device!r}, but this machine has no CUDA "
                          "GPU (torch.cuda.device_count() is 0); allowed here: train.device=cpu")  # fmt: skip
    try:
        plan_node(gpus, Layout(cfg.topology).components,
                  tensor_parallel=cfg.engine.tensor_parallel, mode=cfg.topology.placement)  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{_why_gpus(cfg)} on this machine's {gpus} GPUs: {e}") from None


def _run_dir(cfg: RunConfig, run_dir: Path, where: Where, resume: bool,
             config: Path | None) -> None:  # fmt: skip
    """The run directory can be written, and a run already in it continued with `cfg`."""
    from gyre.runtime.coordinator.resume import check_run_dir

    _writable(run_dir, "run directory", "runs_dir=DIR or --run-dir DIR" if where is Where.HERE
              else "GYRE_RUN_DIR=DIR")  # fmt: skip
    fsafe.check_outputs_apart({"run directory": run_dir}, config_inputs(cfg, config))
    key = "--resume" if resume else "--run-dir" if where is Where.HERE else "GYRE_RUN_DIR"
    # the job's --steps (GYRE_STEPS, submit --steps) may differ from its config's: not compared
    check_run_dir(run_dir, cfg, key=key, same_config=not resume, steps=where is Where.HERE)


def config_inputs(cfg: RunConfig, config: Path | None) -> dict[str, Path]:
    """The files a run config reads, which a run's or evaluation's outputs must stay apart
    from: the config file itself (None: leave it out), a model directory, suite paths."""
    found = {} if config is None else {"the config": config}
    if Path(cfg.model).is_dir():
        found["the model"] = Path(cfg.model)
    for key, suite in (("harness.suite", cfg.harness.suite), ("eval.suite", cfg.eval.suite)):
        for s in [suite] if isinstance(suite, str) else suite or []:
            if Path(s).exists():
                found[f"{key} {s}"] = Path(s)
    return found


def _writable(path: Path, key: str, how: str) -> None:
    """`path` exists as a directory gyre can write, or can be made (`cliargs.directory_to_make`
    makes and removes a probe directory); `how` names the keys that choose another."""
    from gyre.cliargs import directory_to_make

    try:
        directory_to_make(str(path))
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{key}: {e} ({how})") from None


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
