"""A cell's engine that dies around a publication never takes the job down.

The core pushes new weights to every rollout engine. An engine SIGKILLed just before (its
loss not yet seen by the coordinator) refuses the push; the core must report it as missed and
go on, and the engine restarted afterwards must serve the published version, not the one it
had before. Real engine processes, a real replica, real HTTP pushes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from gyre.runtime.cell import PUBLISHED, CellProcess, build_replica
from gyre.runtime.config import load_run_config
from gyre.runtime.engine_host import EngineProcess, http

from .conftest import small_config, write_config


def _cell(tmp_path: Path, index: int, engine: EngineProcess, core: bool) -> CellProcess:
    cfg = load_run_config(write_config(tmp_path, small_config(tmp_path)))
    replica, optim = build_replica(cfg, core=core)
    cell = CellProcess(cfg, engine_index=index, comms=None, run_dir=tmp_path, engine=engine,
                       replica=replica, optimizer=optim)  # fmt: skip
    cell.sent = []  # type: ignore[attr-defined]
    cell._up = cell.sent.append  # type: ignore[attr-defined,method-assign]
    return cell


def _engine(tmp_path: Path, name: str) -> EngineProcess:
    cfg = load_run_config(write_config(tmp_path, small_config(tmp_path)))
    engine = EngineProcess(cfg.model, cfg.engine, tmp_path / f"{name}.log", version=0)
    engine.spawn()
    engine.wait_ready(cfg.timeouts.startup_s)
    return engine


def test_publish_to_a_killed_engine_is_reported_and_its_restart_serves_the_new_version(
    tmp_path: Path,
) -> None:
    live, doomed = _engine(tmp_path, "e0"), _engine(tmp_path, "e2")
    try:
        core = _cell(tmp_path, 0, live, core=True)
        victim = _cell(tmp_path, 2, doomed, core=False)
        with torch.no_grad():  # the core's weights after a step: different from version 0
            for p in core.replica.model.parameters():  # type: ignore[union-attr]
                p.add_(0.01)
        assert doomed.proc is not None
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()

        core._publish(1, [(0, live.url), (2, doomed.url)])

        kind, version, _seconds, missed = core.sent[-1]  # type: ignore[attr-defined]
        assert (kind, version, missed) == ("published", 1, [2])
        assert http(live.url, "GET", "/get_weight_version")["weight_version"] == "1"
        assert torch.load(tmp_path / PUBLISHED, weights_only=True)["version"] == 1

        # the dead engine's cell sees the loss; its restart loads the published copy
        victim._watch_engine()
        assert victim.sent[-1][0] == "engine_lost"  # type: ignore[attr-defined]
        victim._respawn("rollout")
        assert victim.sent[-1] == ("engine_ready", 2, doomed.url, 1)  # type: ignore[attr-defined]
        assert http(doomed.url, "GET", "/get_weight_version")["weight_version"] == "1"

        # a reload of an engine that already has the version changes nothing and never fails
        victim._reload()
        assert doomed.version == 1
    finally:
        live.stop()
        doomed.stop()


def test_a_switch_goes_on_when_the_engine_died_under_it(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "e1")
    try:
        cell = _cell(tmp_path, 1, engine, core=False)
        assert engine.proc is not None
        os.kill(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        cell._to_train(0)
        assert cell.sent[-1][:3] == ("switched", 1, "train")  # type: ignore[attr-defined]
        cell._to_rollout(0)
        assert cell.sent[-1][:3] == ("switched", 1, "rollout")  # type: ignore[attr-defined]
    finally:
        engine.stop()
