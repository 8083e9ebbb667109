"""A cell's engine that dies around a publication never takes the job down.

The core pushes new weights to every rollout engine. An engine SIGKILLed just before (its
loss not yet seen by the coordinator) refuses the push; the core must report it as missed and
go on, and the engine restarted afterwards must serve the published version (from the policy
directory the publication wrote first), not the one it had before. Real engine processes, a
real replica, real HTTP pushes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from gyre.rollout.client import EngineClient, blocking
from gyre.rollout.protocol import SamplingParams
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.cell.leader import CellProcess
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import policies
from gyre.runtime.shared.config import load_run_config
from gyre.train.comm import Communicators
from gyre.vocabulary import Role

from .conftest import small_config, write_config


def _cell(tmp_path: Path, index: int, engine: EngineHost, core: bool) -> CellProcess:
    cfg = load_run_config(write_config(tmp_path, small_config(tmp_path)))
    replica = cfg.train_backend.build(cfg.model, cfg.train, cfg.dims, core=core,
                                      device=cfg.train.device)  # fmt: skip
    cell = CellProcess(cfg, engine_index=index, comms=Communicators.alone(index), run_dir=tmp_path,
                       engine=engine, replica=replica)  # fmt: skip
    cell.sent = []  # type: ignore[attr-defined]
    cell._up = cell.sent.append  # type: ignore[attr-defined,method-assign]
    return cell


def _engine(tmp_path: Path, name: str) -> EngineHost:
    cfg = load_run_config(write_config(tmp_path, small_config(tmp_path)))
    engine = EngineHost(cfg.model, cfg.engine, tmp_path / f"{name}.log", version=0)
    engine.spawn()
    engine.wait_ready(cfg.timeouts.startup_s)
    return engine


def _greedy(url: str) -> tuple[str, list[int], list[float]]:
    """(weight version, tokens, log-probs) of one greedy call: the weights an engine serves."""
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    result = blocking(url, lambda client: client.generate([1, 2, 3, 4, 5], sampling, "probe"))
    return result.weight_version, result.output_ids, result.output_logprobs


@pytest.mark.slow
def test_publish_to_a_killed_engine_is_reported_and_its_restart_serves_the_new_version(
    tmp_path: Path,
) -> None:
    live, doomed = _engine(tmp_path, "e0"), _engine(tmp_path, "e2")
    try:
        core = _cell(tmp_path, 0, live, core=True)
        victim = _cell(tmp_path, 2, doomed, core=False)
        with torch.no_grad():  # the core's weights after a step: different from version 0
            for p in core.replica.cell.model.parameters():  # type: ignore[union-attr]
                p.add_(0.01)
        assert doomed.proc is not None
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()

        assert core.trainer is not None
        core.trainer.version = 1
        core.publish(msg.Publish(version=1, targets=[(0, live.url), (2, doomed.url)]))

        done = core.sent[-1]  # type: ignore[attr-defined]
        assert isinstance(done, msg.Published) and (done.version, done.missed) == (1, [2])
        assert blocking(live.url, EngineClient.weight_version) == "1"
        kept = policies.latest(tmp_path)
        assert kept is not None and kept[0] == 1 and kept[1].name == "v00001"

        # the dead engine's cell sees the loss; its restart loads the published policy
        victim._watch_engine()
        assert isinstance(victim.sent[-1], msg.EngineLost)  # type: ignore[attr-defined]
        victim.respawn(msg.Respawn(Role.ROLLOUT))
        assert victim.sent[-1] == msg.EngineReady(2, doomed.url, 1)  # type: ignore[attr-defined]
        assert blocking(doomed.url, EngineClient.weight_version) == "1"
        served = dict(policies.load_weights(kept[1]))
        name, want = next(iter(served.items()))
        assert torch.equal(want, dict(core.replica.cell.model.state_dict())[name])  # type: ignore[union-attr]

        # a reload of an engine that already has the version changes nothing and never fails
        victim.reload(msg.Reload())
        assert doomed.version == 1

        # the same engine lost again, after it had loaded v1: its new process starts from the
        # base model, and the restart must bring back v1's weights, not only v1's label
        assert doomed.proc is not None
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        victim._watch_engine()
        victim.respawn(msg.Respawn(Role.ROLLOUT))
        assert victim.sent[-1] == msg.EngineReady(2, doomed.url, 1)  # type: ignore[attr-defined]
        assert _greedy(doomed.url) == _greedy(live.url)  # same weights: same tokens, log-probs
    finally:
        live.stop()
        doomed.stop()


@pytest.mark.slow
def test_a_switch_goes_on_when_the_engine_died_under_it(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "e1")
    try:
        cell = _cell(tmp_path, 1, engine, core=False)
        assert engine.proc is not None
        os.kill(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        cell.to_train(msg.ToTrain())
        last = cell.sent[-1]  # type: ignore[attr-defined]
        assert isinstance(last, msg.Switched) and (last.cell, last.role) == (1, Role.TRAIN)
        cell.to_rollout(msg.ToRollout(0))
        last = cell.sent[-1]  # type: ignore[attr-defined]
        assert isinstance(last, msg.Switched) and (last.cell, last.role) == (1, Role.ROLLOUT)
    finally:
        engine.stop()
