"""One preflight for every way a run starts: what a run config must pass before any process
of its job starts.

`gyre run` (`Where.HERE`: this machine runs the job), `gyre render` (`Where.ANYWHERE`: a
script is written, maybe far from the cluster), `gyre render --check` and `gyre submit`
(`Where.CLUSTER`: the cluster's login node) and the job's own first step, `python -m
gyre.launch.check` (`Where.JOB`: inside the allocation), all call `preflight`, so a config
one of them passes is one the others pass too and the job does not fail after waiting in the
queue. Each check belongs to its domain and is the one the ranks run (or run into); here they
are only listed, as `Check`s (`gyre.runtime.shared.checks`: a name and `run(cfg, site)`), and
run in order (`CHECKS`):

* this machine's ranks (`gyre.runtime.shared.placement.check_ranks_here`, `gyre run` only):
  at most `placement.RANKS_PER_CPU` per CPU — first, so a cluster config is told to go to
  the cluster;
* the harness (`gyre.runtime.shared.harness.check`): the adapter is known and its `params`
  declared and of their types (`Adapter.check_params`); the suite loads and names every task
  of `harness.tasks` (a suite path missing here is a note from `render`, an error from the
  others); the adapter's program is installed (an error where the job runs, `HERE` and `JOB`;
  a note on the login node, not checked by `render`); the sandbox works (`HERE`; on a cluster
  the proxy node checks it as it starts);
* the held-out set of validation while training (`eval.every_steps`): it loads, and a training
  task it would reuse has held-out seeds (`gyre.runtime.shared.heldout.heldout`);
* this machine's backends and devices (`gyre.runtime.shared.placement.check_devices_here`,
  `gyre run` only): what this machine can run (`RunConfig.check_machine`) and the plan on its
  own CUDA devices; on a cluster, every cell node and standalone node places its ranks and
  engine on `slurm.gpus_per_node` GPUs instead (`placement.check_gpus`: `plan_node`, the plan
  each rank makes at start) — with the login node's Slurm log folder, called by the launch
  layer (`gyre.launch.spec.load_launch`), which owns the Slurm section;
* the model (`gyre.models`): it loads (a directory missing here is a note on the login node,
  not checked by `render`), its vocab covers its tokenizer, the embedded engine can batch its
  KV cache, and the training backend can lay it out (what the cell ranks compute); a
  shipped tiny model's layout check is remembered once passed (`passed_before`), since its
  config comes from Gyre's own code;
* the memory plan (`gyre.runtime.shared.memory.check`): every rank of the core cell and its
  engine fit their device (`gyre.train.memory`) — on GPUs `topology.gpu_memory_gb`, on the
  CPU only where `topology.cpu_memory_gb` is set;
* the experiment trackers (`gyre.tracking.check`);
* the run directory (`gyre.runtime.shared.run_directory.check`): it can be written, and a
  run already in it can be continued with this config (`--resume`, `--run-dir` of an existing
  run, a requeued job's `GYRE_RUN_DIR`).

Returns the notes to print (the config's warnings, what could not be checked where it runs).
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre import cache
from gyre.errors import ConfigError
from gyre.runtime.shared import harness, memory, placement, run_directory
from gyre.runtime.shared.checks import RUNS_HERE, Check, Site, Where
from gyre.runtime.shared.checks import elsewhere as _elsewhere

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig

__all__ = ["CHECKS", "Where", "preflight"]


def preflight(cfg: RunConfig, where: Where, *, run_dir: Path | None = None,
              resume: bool = False, config: Path | None = None) -> list[str]:  # fmt: skip
    """Raise `ConfigError` (one line: what is wrong, what is allowed) at the first problem;
    return the notes. `run_dir`: the run directory the job will use (`gyre run`, the job's
    `GYRE_RUN_DIR`); `resume`: it is continued with the run's own config plus overrides;
    `config`: the config file a new run was started from (the run directory stays apart)."""
    site = Site(where, run_dir=run_dir, resume=resume, config=config)
    notes = list(cfg.warnings())
    for check in CHECKS:
        notes += check.run(cfg, site)
    return notes


def _check_model(cfg: RunConfig, site: Site) -> list[str]:
    """The model's check (`_model`), as far as `site.where` sees."""
    return _model(cfg, site.where)


def _check_trackers(cfg: RunConfig, site: Site) -> list[str]:
    """The trackers open (the MLflow URI everywhere, their packages where the job runs)."""
    from gyre.tracking import check as check_tracking

    check_tracking(cfg.tracking, installed=site.where in RUNS_HERE)
    return []


def _check_heldout(cfg: RunConfig, site: Site) -> list[str]:
    """Validation while training (`eval.every_steps`): the held-out set it runs loads
    (`gyre.runtime.shared.heldout.heldout`), where the job runs."""
    if not cfg.eval.every_steps or site.where not in RUNS_HERE:
        return []
    from gyre.runtime.shared.heldout import heldout

    try:
        heldout(cfg, None)
    except ConfigError as e:
        raise ConfigError(
            f"eval.every_steps: {cfg.eval.every_steps} needs a held-out set: {e}"
        ) from None
    return []


CHECKS: tuple[Check, ...] = (
    Check("ranks here", placement.check_ranks_here),
    Check("harness", harness.check),
    Check("held-out set", _check_heldout),
    Check("devices here", placement.check_devices_here),
    Check("model", _check_model),
    Check("memory", memory.check),
    Check("trackers", _check_trackers),
    Check("run directory", run_directory.check),
)
"""The domains a run config passes, in order: the first problem is the one reported."""


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
    trains = cfg.train_backend.check_model  # None: the backend trains any model that loads
    if shipped and trains is None:
        return []
    stamp = _stamp(cfg) if tiny_size(model) is not None else None
    if stamp is not None and stamp.is_file():
        return []
    config = model_config(model)
    if config is None:
        return []
    if not shipped:
        check_tokenizer(model, config)
    if trains is not None:
        try:
            trains(config.to_dict(), cfg.dims)
        except ConfigError as e:
            raise ConfigError(f"model: {model!r} with train.backend {cfg.train.backend}: "
                              f"{e}") from None  # fmt: skip
    if not shipped and cfg.engine.backend == "embedded":
        check_batchable(model, config)
    _check_engine_experts(cfg, config.to_dict())
    _check_routing_replay(cfg, config.to_dict())
    if stamp is not None:
        _remember(stamp)
    return []


def _check_engine_experts(cfg: RunConfig, hf: dict[str, Any]) -> None:
    """`engine.expert_parallel` > 1 splits routed experts: the model has them, evenly."""
    from gyre.train.megatron.config import num_experts  # torch-free

    ep, experts = cfg.engine.expert_parallel, num_experts(hf)
    if ep > 1 and (not experts or experts % ep):
        raise ConfigError(
            f"engine.expert_parallel: {ep} with model {cfg.model!r} ({experts or 'no'} routed "
            "experts); allowed: 1, or a divisor of its expert count for a mixture-of-experts "
            "model"
        )


def _check_routing_replay(cfg: RunConfig, hf: dict[str, Any]) -> None:
    """`train.routing_replay: true` needs routed experts to replay."""
    from gyre.train.megatron.config import num_experts  # torch-free

    if cfg.train.routing_replay is True and not num_experts(hf):
        raise ConfigError(
            f"train.routing_replay: true with model {cfg.model!r}, which routes no experts; "
            "allowed: true for a mixture-of-experts model, or false / auto"
        )


def passed_dir() -> Path:
    """Where passed model checks are remembered: `$GYRE_CACHE_DIR/checks` (default
    `~/.cache/gyre/checks`)."""
    return cache.root() / "checks"


def _stamp(cfg: RunConfig) -> Path:
    """The file that says a tiny model's layout check passed (`_model`): named by everything
    its result depends on — the model, the backend and its parallel layout, the versions of
    transformers and megatron-core, and every source file of Gyre — so it cannot outlive a
    change that could change the answer. Building the tiny config imports transformers and
    torch (~2 CPU-s, before any rank starts); a run that passed once skips it."""
    h = hashlib.sha256()
    h.update(repr((cfg.model, cfg.train.backend, cfg.dims)).encode())
    for dist in ("transformers", "megatron-core", "torch"):
        try:
            h.update(f"{dist}={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none;".encode())
    root = Path(__file__).resolve().parents[1]  # the gyre package
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return passed_dir() / f"model-{h.hexdigest()[:32]}"


def _remember(stamp: Path) -> None:
    """Leave the stamp of a passed check; a cache that cannot be written is only not kept."""
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass
