"""The loop of a cell rank other than the leader: its share of training, no engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre.errors import TrainingError
from gyre.runtime.cell.trainer import CellTrainer
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import wire

IDLE_S = 0.05
"""How long a cell rank waits for a message before it watches its engine and, on the core,
serves snapshot pulls (`CellTrainer.idle`)."""


class CellFollower:
    """A cell rank other than the leader: takes its part of every training pass, no engine.

    The coordinator sends the cell's training messages (Prepass, Accumulate, Reduce), its
    role switches (ToTrain, ToRollout: a trainer sharing its GPU with the engine moves its
    state), the core's SaveCheckpoint and Stop to every rank of the cell; only the leader
    answers.
    """

    def __init__(self, trainer: CellTrainer) -> None:
        self.trainer = trainer

    def serve(self, link: wire.Link) -> int:
        t = self.trainer
        handlers: dict[type, Callable[[Any], object]] = {
            msg.Prepass: t.prepass, msg.Accumulate: t.accumulate, msg.Reduce: t.reduce,
            msg.SaveCheckpoint: t.save_checkpoint,
            msg.ToTrain: lambda _: t.to_train(), msg.ToRollout: lambda _: t.to_rollout(),
        }  # fmt: skip
        while True:
            m = link.recv(timeout=IDLE_S if t.core else 3600.0)
            t.idle()
            if m is None:
                continue
            if isinstance(m, msg.Stop):
                return m.status
            handler = handlers.get(type(m))
            if handler is None:
                raise TrainingError(
                    f"cell {t.comms.cell_id} rank {t.comms.shard}: got {type(m).__name__}; "
                    "a follower only takes Prepass, Accumulate, Reduce, SaveCheckpoint, "
                    "ToTrain, ToRollout and Stop"
                )
            handler(m)
