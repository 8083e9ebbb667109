"""Experiment tracking on CPU without a network: each tracker's own reader checks its files.

TensorBoard's event files are read with TensorBoard's `EventAccumulator`, the W&B offline
run with `wandb leet inspect --json` (W&B's reader of its transaction log), the MLflow store
with `MlflowClient`. A resumed run (same run directory) must continue the same tracker runs.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gyre.config import apply_overrides, load
from gyre.errors import ConfigError
from gyre.tracking import Tracker, TrackingConfig, TrackingError, open_tracker

ROOT = Path(__file__).resolve().parents[1]

RUN_CONFIG = {"name": "local", "steps": 3, "train": {"lr": 1e-4, "j_max": 4}, "tasks": ["add"]}
ALL_ON = ["tensorboard.enabled=true", "wandb.enabled=true", "mlflow.enabled=true"]


def steps(first: int, last: int) -> dict[int, dict[str, float]]:
    return {s: {"loss": 1.0 / s, "reward_mean": 0.1 * s, "grad_norm": math.nan}
            for s in range(first, last + 1)}  # fmt: skip


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    out: dict[str, dict[int, float]] = {}
    for run, tags in mux.Runs().items():
        for tag in tags["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in mux.Scalars(run, tag)})
    return out


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    wandb = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
    records = []
    for offline in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([wandb, "leet", "inspect", "--json", str(offline)],
                             capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        records += [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return records


def test_config_is_strict_and_off_by_default() -> None:
    cfg = load(TrackingConfig, {}, path="run.tracking")
    assert not (cfg.tensorboard.enabled or cfg.wandb.enabled or cfg.mlflow.enabled)
    assert cfg.wandb.mode == "offline" and cfg.mlflow.tracking_uri == ""
    with pytest.raises(ConfigError, match=r"run\.tracking\.wandb: unknown key 'projekt'.*project"):
        load(TrackingConfig, apply_overrides({}, ["wandb.projekt=x"]), path="run.tracking")
    with pytest.raises(ConfigError, match=r"run\.tracking\.wandb\.mode: 'cloud' is not allowed"):
        load(TrackingConfig, {"wandb": {"mode": "cloud"}}, path="run.tracking")


def test_nothing_enabled_writes_nothing(tmp_path: Path) -> None:
    with open_tracker(TrackingConfig(), tmp_path / "run", RUN_CONFIG) as tracker:
        tracker.log_step(1, {"loss": 1.0})
        tracker.log_summary({"steps_done": 1})
    assert tracker.names == [] and not (tmp_path / "run").exists()


class Failing:
    name = "failing"

    def __init__(self) -> None:
        self.calls = 0

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.calls += 1
        raise ConnectionError("tracker server went away")

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Recording(Failing):
    name = "recording"

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.calls += 1


def test_a_failing_tracker_is_dropped_and_the_others_go_on() -> None:
    failing, recording = Failing(), Recording()
    tracker = Tracker([failing, recording])
    tracker.log_step(1, {"loss": 1.0})
    tracker.log_step(2, {"loss": 0.5})
    assert tracker.names == ["recording"] and failing.calls == 1 and recording.calls == 2


def test_missing_package_is_a_tracking_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    cfg = load(TrackingConfig, {"wandb": {"enabled": True}})
    with pytest.raises(
        TrackingError, match=r"tracking\.wandb\.enabled: .*pip install -e \.\[tracking\]"
    ):
        open_tracker(cfg, tmp_path / "run", RUN_CONFIG)


@pytest.mark.slow
def test_all_trackers_write_steps_config_and_summary_and_resume(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    cfg = load(TrackingConfig, apply_overrides({}, ALL_ON), path="run.tracking")
    run_dir = tmp_path / "local-elastic-1"
    with open_tracker(cfg, run_dir, RUN_CONFIG) as tracker:
        assert tracker.names == ["tensorboard", "wandb", "mlflow"]
        for step, metrics in steps(1, 2).items():
            tracker.log_step(step, metrics)
    with open_tracker(cfg, run_dir, RUN_CONFIG) as tracker:  # the run resumed in its directory
        tracker.log_step(3, steps(3, 3)[3])
        tracker.log_summary({"steps_done": 3, "policy": "elastic", "resumed_from": 2})
    with open_tracker(cfg, run_dir, RUN_CONFIG) as tracker:  # gyre eval --initial, later
        tracker.log_eval(0, {"reward_mean": 0.2})
        tracker.log_eval(3, {"reward_mean": 0.7})

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    assert scalars["reward_mean"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert math.isnan(scalars["grad_norm"][2]) and scalars["summary/steps_done"] == {3: 3.0}
    assert scalars["eval/reward_mean"] == pytest.approx({0: 0.2, 3: 0.7})  # at versions

    records = wandb_records(run_dir)
    runs = [r["run"] for r in records if r["type"] == "run"]
    assert len(runs) == 3 and len({r["run_id"] for r in runs}) == 1  # one W&B run, resumed
    assert runs[0]["config"]["update"]["train"] == {"lr": 1e-4, "j_max": 4}
    history = {r["history"]["step"]["num"]: r["history"]["item"]
               for r in records if r["type"] == "history"}  # fmt: skip
    assert sorted(history) == [1, 2, 3] and history[2]["loss"] == 0.5
    summary = [r["summary"]["update"] for r in records if r["type"] == "summary"]
    assert any(s.get("policy") == "elastic" and s.get("steps_done") == 3 for s in summary)
    held = {k: v for s in summary for k, v in s.items() if k.startswith("eval/")}
    assert held == {"eval/reward_mean/v0": 0.2, "eval/reward_mean/v3": 0.7}

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gyre").experiment_id])
    assert run.info.run_name == "local-elastic-1" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.0001" and run.data.params["tasks"] == '["add"]'
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert loss == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    held = client.get_metric_history(run.info.run_id, "eval/reward_mean")
    assert {m.step: m.value for m in held} == pytest.approx({0: 0.2, 3: 0.7})
    assert (
        run.data.metrics["summary.steps_done"] == 3 and run.data.tags["summary.policy"] == "elastic"
    )
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert "lr: 0.0001" in Path(config).read_text()


def test_gyre_eval_results_reach_the_runs_trackers(tmp_path: Path) -> None:
    """`gyre eval RUN_DIR` sends each evaluated policy's held-out reward to the run's
    trackers at its policy version; a model given by path (no version) is not sent."""
    from gyre.runtime.evaluation import EvalResult, _track
    from gyre.runtime.shared.config import load_run_config

    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text((ROOT / "templates" / "local.yaml").read_text())
    cfg = load_run_config(cfg_path)
    run_dir = tmp_path / "run"
    results = [
        EvalResult("initial", 0, "tiny", {"a": 0.0, "b": 0.5}),
        EvalResult("final", 40, "p", {"a": 1.0, "b": None}),
        EvalResult("other", None, "/m", {"a": 1.0}),
    ]
    _track(cfg, run_dir, results)  # tracking off in the template: nothing written
    assert not run_dir.exists()
    cfg.tracking.tensorboard.enabled = True
    _track(cfg, run_dir, results)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["eval/reward_mean"] == pytest.approx({0: 0.25, 40: 1.0})
    assert scalars["eval/excluded"] == pytest.approx({0: 0.0, 40: 1.0})
