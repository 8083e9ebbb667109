"""Experiment tracking: a run's per-step metrics and config to TensorBoard, W&B and MLflow.

The trace's `steps` table is the run's own record of its metrics; a `Tracker` sends the same
per-step metrics (and the run config, and a final summary) to the trackers users already
watch. All are off by default and work without a network, because compute nodes of HPC
clusters usually have none:

* TensorBoard — event files in `RUN_DIR/tensorboard` (`tensorboard --logdir RUN_DIR`);
* W&B — offline by default: `RUN_DIR/wandb/offline-run-*`, uploaded later with
  `wandb sync RUN_DIR/wandb/offline-run-*` (mode `online` logs live where there is a network);
* MLflow — a local SQLite store `RUN_DIR/mlflow/mlflow.db` by default (MLflow 3 keeps its
  plain file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true),
  viewed with `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow/mlflow.db`, or any
  tracking URI (a server, `file:` with that variable set).

A run directory keeps one tracker run: a resumed run (same directory) continues the W&B run
(a fixed id) and the MLflow run (found by its `gyre.run_dir` tag), and TensorBoard appends.
Opening a tracker that is enabled but not installed, or that cannot start, is a
`TrackingError`; a tracker that fails later is logged and dropped, never failing the run.
`check(cfg)` refuses, before any process starts (`gyre.runtime.preflight`), what opening would:
an enabled tracker whose package is missing, an MLflow tracking URI MLflow has no store for
(`check_mlflow_uri`, which the MLflow tracker calls as it opens, too).

    tracker = open_tracker(cfg.tracking, run_dir, run_config=to_dict(cfg))
    tracker.log_step(step, {"loss": 0.4, "reward_mean": 0.3})
    tracker.log_eval(version, {"reward_mean": 0.6})      # gyre eval, eval.every_steps
    tracker.log_samples(step, {"eval-s10-notes-0": transcript})  # eval.log_samples
    tracker.log_summary(summary)
    tracker.close()

Packages: `pip install -e .[tracking]` (docs/tracking.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml

from gyre.errors import ConfigError, GyreError

log = logging.getLogger(__name__)


EVAL_PREFIX = "eval/"  # held-out evaluation metrics (`Tracker.log_eval`)


class TrackingError(GyreError):
    """An enabled experiment tracker is not installed or could not be opened."""


@dataclass(kw_only=True, slots=True)
class TensorBoardConfig:
    """TensorBoard event files (written through torch.utils.tensorboard)."""

    enabled: bool = False
    """Write event files."""
    log_dir: str = ""
    """Event file directory; "" = RUN_DIR/tensorboard."""


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases."""

    enabled: bool = False
    """Log to W&B."""
    mode: Literal["offline", "online"] = "offline"
    """offline: files for a later `wandb sync` (no network needed); online: live."""
    project: str = "gyre"
    """W&B project."""
    entity: str = ""
    """W&B entity (team or user); "" = the account's default."""
    group: str = ""
    """Run group; "" = none."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""
    dir: str = ""
    """Where W&B writes its `wandb/` folder; "" = RUN_DIR."""


@dataclass(kw_only=True, slots=True)
class MlflowConfig:
    """MLflow tracking."""

    enabled: bool = False
    """Log to MLflow."""
    tracking_uri: str = ""
    """Tracking URI; "" = sqlite:///RUN_DIR/mlflow/mlflow.db (artifacts beside it)."""
    experiment: str = "gyre"
    """Experiment name (created if missing)."""


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    """Experiment trackers fed the run's per-step metrics (all off by default)."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard event files."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (offline by default)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow (a SQLite store in the run directory by default)."""
    run_name: str = ""
    """Run name shown by the trackers; "" = the run directory's name."""


PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The package each tracker needs (TensorBoard: torch.utils.tensorboard imports it)."""
MLFLOW_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                  "databricks-uc", "uc")  # fmt: skip
"""Tracking URI schemes MLflow 3 has a store for, besides its file store (a path or file:),
which it refuses unless MLFLOW_ALLOW_FILE_STORE=true."""


def check(cfg: TrackingConfig, *, installed: bool = True) -> None:
    """`ConfigError` (one line) for what opening the enabled trackers would refuse: the
    MLflow URI, and with `installed` (where the job runs) a tracker package not installed."""
    if cfg.mlflow.enabled:
        check_mlflow_uri(cfg.mlflow.tracking_uri)
    for name, module in PACKAGES.items() if installed else ():
        if getattr(cfg, name).enabled and not _importable(module):
            raise ConfigError(f"tracking.{name}.enabled: true, but the {name} package is not "
                              "installed here; allowed: pip install -e .[tracking], or "
                              f"tracking.{name}.enabled=false")  # fmt: skip


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def check_mlflow_uri(uri: str, env: Mapping[str, str] = os.environ) -> None:
    """`ConfigError` unless MLflow has a tracking store for `uri` ("" is the run's own SQLite
    store); the scheme is read as MLflow reads it (`mlflow.utils.uri.get_uri_scheme`)."""
    if not uri:
        return
    named = uri in ("databricks", "databricks-uc", "uc")
    scheme = uri if named else urllib.parse.urlparse(uri).scheme
    base = scheme.lower().split("+", 1)[0]
    allowed = ("allowed: '' (sqlite:///RUN_DIR/mlflow/mlflow.db), sqlite:///PATH, "
               "http(s)://HOST[:PORT], postgresql://, mysql://, mssql://, databricks")  # fmt: skip
    key = f"tracking.mlflow.tracking_uri: {uri!r}"
    if len(base) <= 1 or base == "file":  # a path (C: too): MLflow's file store
        if env.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
            return
        raise ConfigError(f"{key} is MLflow's file store, which MLflow 3 refuses unless "
                          f"MLFLOW_ALLOW_FILE_STORE=true; {allowed}")  # fmt: skip
    if base not in MLFLOW_SCHEMES:
        raise ConfigError(f"{key}: MLflow has no tracking store for scheme {scheme!r}; {allowed}")
    if base in ("http", "https") and not urllib.parse.urlparse(uri).netloc:
        raise ConfigError(f"{key}: no host; {allowed}")


class _Backend(Protocol):
    name: str

    def log_step(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_eval(self, version: int, metrics: dict[str, float]) -> None: ...

    def log_samples(self, step: int, samples: dict[str, dict[str, Any]]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Tracker:
    """The open trackers of one run; each call goes to all of them."""

    def __init__(self, backends: list[_Backend]) -> None:
        self.backends = backends

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """One optimizer step's metrics (the rows the trace's `steps` table gets)."""
        values = {k: float(v) for k, v in metrics.items()}
        self._each("log_step", step, values)

    def log_eval(self, version: int, metrics: dict[str, float]) -> None:
        """A held-out evaluation (`gyre eval`) of the policy of weight version `version`:
        `eval/<name>` metrics whose x-axis is the policy version (the optimizer step
        that produced it), so they line up with the training curves."""
        values = {f"{EVAL_PREFIX}{k}": float(v) for k, v in metrics.items()}
        self._each("log_eval", version, values)

    def log_samples(self, step: int, samples: Mapping[str, Mapping[str, Any]]) -> None:
        """Transcripts of an in-run evaluation at `step` (execution id -> `transcript`):
        TensorBoard text, a W&B table, an MLflow text artifact, under `eval/samples`."""
        self._each("log_samples", step, {k: dict(v) for k, v in samples.items()})

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The run's final summary: numbers as metrics, everything else as text."""
        self._each("log_summary", _flatten(summary))

    def close(self) -> None:
        """Finish every tracker run (files flushed); safe to call twice."""
        self._each("close")
        self.backends = []

    def _each(self, method: str, *args: Any) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception as e:
                log.warning("tracking: %s %s failed, dropping it: %s", backend.name, method, e)
                self.backends.remove(backend)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tracker(cfg: TrackingConfig, run_dir: str | Path, run_config: dict[str, Any]) -> Tracker:
    """Open every enabled tracker for the run in `run_dir`, logging `run_config` once."""
    run = _Run(dir=Path(run_dir).resolve(), name="", config=run_config)
    run.name = cfg.run_name or run.dir.name
    openers: list[tuple[bool, str, Any]] = [
        (cfg.tensorboard.enabled, "tensorboard", lambda: _TensorBoard(cfg.tensorboard, run)),
        (cfg.wandb.enabled, "wandb", lambda: _Wandb(cfg.wandb, run)),
        (cfg.mlflow.enabled, "mlflow", lambda: _Mlflow(cfg.mlflow, run)),
    ]
    backends: list[_Backend] = []
    try:
        for enabled, what, opener in openers:
            if enabled:
                backends.append(_open(what, opener))
    except BaseException:
        Tracker(backends).close()
        raise
    return Tracker(backends)


@dataclass(slots=True)
class _Run:
    """What every tracker is opened with."""

    dir: Path
    name: str
    config: dict[str, Any]

    @property
    def id(self) -> str:
        """A tracker run id fixed by the run directory (a resumed run keeps it)."""
        return hashlib.sha256(str(self.dir).encode()).hexdigest()[:16]


def _open(what: str, opener: Any) -> _Backend:
    try:
        return opener()  # type: ignore[no-any-return]
    except ImportError as e:
        raise TrackingError(
            f"tracking.{what}.enabled: the {what} package is not installed ({e}); "
            "install the extra: pip install -e .[tracking]"
        ) from None
    except TrackingError:
        raise
    except Exception as e:
        raise TrackingError(f"tracking.{what}: could not open the tracker: {e}") from e


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists and other non-scalars as JSON text."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        elif value is None or isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


SAMPLES = f"{EVAL_PREFIX}samples"  # the samples' tag, table and artifact folder


def samples_markdown(step: int, samples: Mapping[str, Mapping[str, Any]]) -> str:
    """Evaluation transcripts as markdown: per execution, each message, then the final answer."""
    out = [f"## Held-out samples at step {step}"]
    for eid, said in samples.items():
        out.append(f"### {eid} ({said.get('calls', 0)} calls)")
        for m in said.get("messages", []):
            text = str(m.get("content", "")).replace("\n", "\n    ")
            out.append(f"**{m.get('role', '?')}**:\n\n    {text}\n")
        out.append(f"**final answer**: `{said.get('final_answer', '')}`")
    return "\n\n".join(out)


def _numbers(flat: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in flat.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


# -- TensorBoard ------------------------------------------------------------------------------


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, cfg: TensorBoardConfig, run: _Run) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else run.dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.last_step = 0
        text = yaml.safe_dump(run.config, sort_keys=False)
        self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))
        self.writer.flush()

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.last_step = step
        self.writer.flush()

    def log_eval(self, version: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=version)
        self.writer.flush()

    def log_samples(self, step: int, samples: dict[str, dict[str, Any]]) -> None:
        self.writer.add_text(SAMPLES, samples_markdown(step, samples), global_step=step)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        for key, value in _numbers(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, global_step=self.last_step)
        self.writer.add_text("summary", f"    {json.dumps(summary, indent=1, default=str)}")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# -- Weights & Biases -------------------------------------------------------------------------


class _Wandb:
    name = "wandb"

    def __init__(self, cfg: WandbConfig, run: _Run) -> None:
        import wandb

        folder = Path(cfg.dir) if cfg.dir else run.dir
        folder.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity or None,
            group=cfg.group or None,
            tags=list(cfg.tags) or None,
            dir=str(folder),
            name=run.name,
            id=run.id,
            resume="allow",
            config=run.config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_eval(self, version: int, metrics: dict[str, float]) -> None:
        # summary values, not history: W&B history steps only grow, an evaluation of
        # version 0 comes after the run's last step, and an offline resume counts from 0
        self.run.summary.update({f"{k}/v{version}": v for k, v in metrics.items()})

    def log_samples(self, step: int, samples: dict[str, dict[str, Any]]) -> None:
        import wandb

        rows = [[step, eid, json.dumps(s.get("messages", [])), s.get("final_answer", "")]
                for eid, s in samples.items()]  # fmt: skip
        table = wandb.Table(columns=["step", "execution", "messages", "final_answer"], data=rows)
        self.run.log({f"{SAMPLES}/step{step}": table}, commit=False)  # into the current row

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


# -- MLflow -----------------------------------------------------------------------------------

_MLFLOW_PARAM_CHARS = 500  # the longest param value every MLflow store version accepts
_MLFLOW_BATCH = 100  # params / metrics per log_batch call


class _Mlflow:
    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run: _Run) -> None:
        check_mlflow_uri(cfg.tracking_uri)  # what the preflight checked
        from mlflow.tracking import MlflowClient

        store = run.dir / "mlflow"
        uri = cfg.tracking_uri
        if not uri:
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (store / "artifacts").as_uri() if not cfg.tracking_uri else None
            experiment_id = self.client.create_experiment(cfg.experiment, artifacts)
        self.last_step = 0
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`gyre.run_dir` = '{run.dir}'", max_results=1
        )
        if found:  # a resumed run: continue it (its params, immutable in MLflow, are logged)
            self.run_id = str(found[0].info.run_id)
            self.client.update_run(self.run_id, status="RUNNING")
            return
        tags = {"gyre.run_dir": str(run.dir)}
        self.run_id = str(
            self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
        )
        self._log_config(run.config)

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = _flatten(config)
        params = [Param(k, str(v)[:_MLFLOW_PARAM_CHARS]) for k, v in flat.items()]
        for i in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _MLFLOW_BATCH])
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self._metrics(metrics, step)
        self.last_step = step

    def log_eval(self, version: int, metrics: dict[str, float]) -> None:
        self._metrics(metrics, version)

    def log_samples(self, step: int, samples: dict[str, dict[str, Any]]) -> None:
        text = samples_markdown(step, samples)
        self.client.log_text(self.run_id, text, f"{SAMPLES}/step{step:06d}.md")

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._metrics({f"summary.{k}": v for k, v in _numbers(summary).items()}, self.last_step)
        for key, value in summary.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                self.client.set_tag(self.run_id, f"summary.{key}", str(value)[:5000])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(k, v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MLFLOW_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
