"""The run directory a job starts in, as the preflight checks it: it can be written, it stays
apart from the files the config reads, and a run already in it can be continued with this
config (`gyre run --resume`, `gyre run --run-dir` of an existing run, a requeued job's
`GYRE_RUN_DIR`).

`check` is this domain's preflight `Check` (`gyre.runtime.shared.checks`); `check_run_dir`
builds the `Handover` the coordinator's `Resume` will build (`gyre.runtime.shared.takeover`)
and refuses, in one line, what the take-over would trip over: a trace or checkpoint that does
not read back, a config other than the run's own (without `--resume`), fewer steps than the
run has done, groups of another size, a model of another shape. `config_inputs` names the
files a run's or an evaluation's outputs must stay apart from.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from gyre import fsafe
from gyre.errors import ConfigError
from gyre.runtime.shared.checks import Site, Where

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig


def check(cfg: RunConfig, site: Site) -> list[str]:
    """The run directory (`site.run_dir`) can be written, stays apart from the config's inputs
    and continues any run in it with `cfg`; unknown on the login node, `runs_dir` can be
    written (the job makes runs_dir/<name>-<job id> there)."""
    if site.run_dir is not None:
        run_dir, where = site.run_dir, site.where
        writable(run_dir, "run directory", "runs_dir=DIR or --run-dir DIR"
                 if where is Where.HERE else "GYRE_RUN_DIR=DIR")  # fmt: skip
        fsafe.check_outputs_apart({"run directory": run_dir}, config_inputs(cfg, site.config))
        key = "--resume" if site.resume else "--run-dir" if where is Where.HERE else "GYRE_RUN_DIR"
        # the job's --steps (GYRE_STEPS, submit --steps) may differ from its config's: not compared
        check_run_dir(run_dir, cfg, key=key, same_config=not site.resume,
                      steps=where is Where.HERE)  # fmt: skip
    elif site.where is Where.CLUSTER:
        writable(Path(cfg.runs_dir), "runs_dir", "runs_dir=DIR")
    return []


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


def writable(path: Path, key: str, how: str) -> None:
    """`path` exists as a directory gyre can write, or can be made (`cliargs.directory_to_make`
    makes and removes a probe directory); `how` names the keys that choose another."""
    from gyre.cliargs import directory_to_make

    try:
        directory_to_make(str(path))
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{key}: {e} ({how})") from None


def check_run_dir(run_dir: Path, cfg: RunConfig, *, key: str, same_config: bool,
                  steps: bool = True) -> None:  # fmt: skip
    """Refuse to start `cfg` in `run_dir` (named by `key`: --resume, --run-dir) when the run
    already there cannot be continued with it: with `same_config`, any config other than the
    run's own (`steps` aside); always, what `Handover.check` refuses or a trace or checkpoint
    that does not read back. A new or empty directory passes."""
    from gyre.config import to_dict
    from gyre.runtime.shared import checkpoint
    from gyre.runtime.shared.config import dump_run_config, load_run_config
    from gyre.runtime.shared.takeover import Handover

    own = run_dir / "config.yaml"
    if not own.is_file():
        if (run_dir / "trace.h5").exists() or (run_dir / checkpoint.CHECKPOINTS).exists():
            raise ConfigError(f"{key} {run_dir}: holds a trace or checkpoints but no "
                              "config.yaml; allowed: a run directory gyre run made, or a new one")  # fmt: skip
        return
    try:  # with this job's steps: a requeued job may run its config with --steps
        run_cfg = load_run_config(own, steps=cfg.steps)
    except ConfigError as e:
        raise ConfigError(f"{key} {run_dir}: its config.yaml does not load ({e}); allowed: a "
                          "run directory of this Gyre version, or a new one") from None  # fmt: skip
    if same_config and dump_run_config(run_cfg) != dump_run_config(cfg):
        where, mine, theirs = _first_difference(to_dict(cfg), to_dict(run_cfg))
        raise ConfigError(
            f"{key} {run_dir}: holds a run of another config ({where}: {mine!r}, the run's: "
            f"{theirs!r}); allowed: the run's own config (gyre run --resume {run_dir} "
            "[KEY.PATH=VALUE ...] continues it with overrides), or a new run directory"
        )
    try:
        handover = Handover(run_dir)
    except Exception as e:  # a damaged trace or checkpoint: h5py, JSON and key errors
        raise ConfigError(
            f"{key} {run_dir}: its trace or checkpoint does not read back "
            f"({type(e).__name__}: {' '.join(str(e).split())}); allowed: a run directory whose "
            f"trace.h5 opens (gyre trace show {run_dir}), or a new run directory"
        ) from None
    handover.check(cfg, run_cfg.model, steps=steps)


def _first_difference(a: object, b: object, path: str = "") -> tuple[str, object, object]:
    """The first key path where the nested mappings `a` and `b` differ, and both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return path, a, b
