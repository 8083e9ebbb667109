"""A cell's rollout engine as a child process of the cell rank.

The engine (`engine.backend`: the embedded engine, `python -m gyre.rollout.cli`, or an SGLang
server; both launched from the `gyre.rollout.sglang.config` presets, with the run's engine
key) runs in its own process so that it can be killed (SIGKILL, OOM) without taking the MPI
world down: the cell notices the exit, reports the loss, and restarts it on request. The
cell drives it with `EngineClient`'s calls made blocking (`gyre.rollout.client.blocking`:
the cell rank has no event loop): release (pause in mode "abort", then
`release_memory_occupation`) and resume (`resume_memory_occupation`, then
`continue_generation`) on role switches, and `update_weights_from_tensor`
(`gyre.rollout.weights.publish_procedure`) to publish. Failures are `EngineError`s
(refused, reset, timed out, an HTTP error, a control call answered ``success: false``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from gyre.errors import ConfigError
from gyre.rollout.client import blocking
from gyre.rollout.protocol import release_procedure, resume_procedure
from gyre.rollout.sglang.config import ServerConfig
from gyre.rollout.sglang.process import EngineProcess
from gyre.runtime.config import EngineConfig


class EngineHost(EngineProcess):
    """A cell's engine: the process, started from the run's `EngineConfig` at the weight
    version it serves, and the blocking control calls the cell makes to it.

    Starting, readiness and stopping are `EngineProcess`'s (one implementation for every
    engine Gyre starts); this class adds what only a cell needs: the launch from the run's
    config (offline Hugging Face hub, torch threads, `labels` in its environment), the
    weight version it serves (a restarted engine is launched at it) and whether it is
    released.
    """

    def __init__(
        self,
        model: str,
        config: EngineConfig,
        log_path: Path,
        version: int,
        labels: dict[str, str] | None = None,
        pace: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.engine_config = model, config
        self.pace = pace  # paced (`PaceConfig.engine`): the embedded engine's --pace
        self.labels = labels or {}  # extra environment: lets operators and tests find it
        self.version = version
        self.released = False
        super().__init__(self._server(), log_path=log_path)

    def _server(self) -> ServerConfig:
        server = self.engine_config.server(self.model, self.version)
        if self.pace is not None:
            if server.launch != "embedded":
                raise ConfigError("pace: only the embedded engine is paced (engine.backend)")
            server = dataclasses.replace(
                server, extra_args=[*server.extra_args, "--pace", json.dumps(self.pace)]
            )
        env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(self.engine_config.threads),
               **self.labels}  # fmt: skip
        return dataclasses.replace(server, env=env)

    def spawn(self) -> None:
        """Start the process at the version the engine serves (returns at once)."""
        self.config = self._server()
        super().spawn()
        self.released = False

    def release(self) -> None:
        """Abort every outstanding call and drop KV caches and weights (ROLLOUT -> TRAIN)."""
        blocking(self.url, lambda client: client.run(release_procedure()))
        self.released = True

    def resume(self) -> None:
        """Restore the weights the engine had and let it generate again (TRAIN -> ROLLOUT)."""
        blocking(self.url, lambda client: client.run(resume_procedure()))
        self.released = False

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish weights of `version` into the engine."""
        push_weights(self.url, named, version)
        self.version = version


def push_weights(url: str, named: list[tuple[str, torch.Tensor]], version: int) -> None:
    """Publish `named` as `version` on the engine at `url`."""
    blocking(url, lambda client: client.update_weights_from_tensor(named, str(version)),
             timeout=600)  # fmt: skip
