"""The loop of a cell rank other than the leader: its share of training and, on a rank that
hosts one of the cell's engines (`gyre.runtime.cell.serving`), that engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gyre.errors import TrainingError
from gyre.runtime.cell.trainer import CellTrainer
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import policies, wire

if TYPE_CHECKING:
    from gyre.runtime.cell.serving import CellEngine
    from gyre.train.comm import Communicators

IDLE_S = 0.05
"""How long a cell rank waits for a message before it watches its engine and, on the core,
serves snapshot pulls (`CellTrainer.idle`)."""


class CellFollower:
    """A cell rank other than the leader: takes its part of every training pass and serves
    its engine if it hosts one.

    The coordinator sends the cell's training messages (Prepass, Accumulate, Reduce), its
    role switches (ToTrain, ToRollout: a trainer sharing its GPU with the engine moves its
    state; an engine here is released or resumed with the cell's), the core's SaveCheckpoint,
    Publish and SavePolicy (each rank writes and sends the weights it holds) and Stop to every rank of the cell;
    only the leader answers them. Respawn and Reload come
    to the rank of the engine they name; engine readiness and losses go up from here.
    """

    def __init__(self, trainer: CellTrainer, served: CellEngine | None = None,
                 engines: int = 1, host: str = "127.0.0.1") -> None:  # fmt: skip
        """`served`: the engine this rank hosts, if any; `engines`: how many the cell has;
        `host`: this rank's address (what it sends a publication's part from)."""
        self.trainer, self.served, self.engines, self.host = trainer, served, engines, host

    def serve(self, link: wire.Link) -> int:
        t, served = self.trainer, self.served
        handlers: dict[type, Callable[[Any], object]] = {
            msg.Prepass: t.prepass, msg.Accumulate: t.accumulate, msg.Reduce: t.reduce,
            msg.SaveCheckpoint: t.save_checkpoint, msg.Publish: self.publish,
            msg.SavePolicy: self.save_policy,
            msg.ToTrain: self.to_train, msg.ToRollout: self.to_rollout,
        }  # fmt: skip
        if served is not None:
            handlers[msg.Respawn] = lambda m: served.respawn(m.role)
            handlers[msg.Reload] = lambda _: served.reload()
            served.announce(served.start())
        if t.version > 0:  # resumed: the leader's engine gets the checkpoint's weights
            self._reload()
        wait = IDLE_S if t.core or served is not None else 3600.0
        while True:
            if served is not None:
                served.watch()
            m = link.recv(timeout=wait)
            t.idle()
            if m is None:
                continue
            if isinstance(m, msg.Stop):
                if served is not None:
                    served.engine.stop()
                return m.status
            handler = handlers.get(type(m))
            if handler is None:
                raise TrainingError(
                    f"cell {t.comms.cell_id} rank {t.comms.shard}: got {type(m).__name__}; "
                    "a follower only takes Prepass, Accumulate, Reduce, SaveCheckpoint, "
                    "Publish, SavePolicy, ToTrain, ToRollout, Stop and, hosting an engine, Respawn and Reload"
                )
            handler(m)

    def publish(self, m: msg.Publish) -> None:
        """The core's publication: this rank writes and sends the part of the weights it
        holds, if any (`Replica.part`: a Megatron stage's sender its stage), when its turn
        comes; the leader answers (`policies.save_parts`, `gyre.runtime.cell.publication`)."""
        from gyre.runtime.cell.publication import publish_parts

        t = self.trainer
        part = t.replica.part(t.comms.shard)
        policies.save_parts(t.comms.cell, part, t.run_dir, policies.version_name(m.version),
                            version=t.version)  # fmt: skip
        publish_parts(t.comms.cell, part, m.targets, m.version, t.cfg.engine, self.host)

    def save_policy(self, m: msg.SavePolicy) -> None:
        """The core's policy `m.name`: this rank writes the part of the weights it holds."""
        t = self.trainer
        policies.save_parts(t.comms.cell, t.replica.part(t.comms.shard), t.run_dir, m.name,
                            version=t.version)  # fmt: skip

    def _reload(self) -> None:
        """This rank's part of the leader's engine's reload (`reload_parts`, as a
        publication: its weights if it holds a part and the leader's engine is behind)."""
        from gyre.runtime.cell.publication import reload_parts

        t = self.trainer
        reload_parts(t.comms.cell, lambda: t.replica.part(t.comms.shard), [], t.version,
                     t.cfg.engine, self.host)  # fmt: skip

    def to_train(self, m: msg.ToTrain) -> None:
        if self.served is not None:
            self.served.release(m.routes, time.perf_counter())
        self.trainer.to_train()
        cell_engines(self.trainer.comms, self.served, self.engines)

    def to_rollout(self, m: msg.ToRollout) -> None:
        self.trainer.to_rollout()
        if self.trainer.core:  # the leader's engine: the weights the cell holds
            self._reload()
        if self.served is not None:  # back after a publication: the newest saved policy
            self.served.resume(m.published)
        cell_engines(self.trainer.comms, self.served, self.engines)


def cell_engines(comms: Communicators, served: CellEngine | None, engines: int) -> dict[str, Any]:
    """After a switch, every rank of a cell of several `engines` tells the leader how its
    engine came out (collective over the cell): the leader gets what its `Switched` records,
    each engine's id, whether it is released and the version it serves; others get {}."""
    if engines == 1:
        return {}
    mine = None if served is None else (served.index, served.engine.released,
                                        served.engine.version)  # fmt: skip
    got = comms.cell.gather(mine, root=0)
    if got is None:
        return {}
    hosted = sorted(g for g in got if g is not None)
    return {"engines": [e for e, _, _ in hosted], "engines_released": [r for _, r, _ in hosted],
            "engine_versions": [v for _, _, v in hosted]}  # fmt: skip
