"""Checkpoints and resume: periodic, atomic, the newest `checkpoint.keep` kept; any crash resumes.

A checkpoint is taken right after an optimizer update — every `checkpoint.every_steps`
updates and/or `checkpoint.every_minutes` — and when Slurm's SIGUSR1 announces the time
limit. It is one directory, written beside its final name and renamed into place, readable
as the umask allows and marked as Gyre's (`gyre.fsafe`: only such a directory is replaced or
pruned):

    RUN_DIR/checkpoints/v<version>/core.pt     the core's weights and AdamW state, both in
                                               the Hugging Face layout whatever the backend
                                               (its format: `gyre.train.core_file`)
    RUN_DIR/checkpoints/v<version>/state.json  updates done, policy version, the groups
                                               trained so far, the next group index

Everything else a resume needs is already in the run's one trace (`trace.h5`), journaled
as it happened: every dispatched group, every closed execution with its tree and verdict,
and the journaled nodes of executions still open when the job died. `gyre run --resume
RUN_DIR` (or the same command with the same `--run-dir`, as a requeued Slurm job runs it)
therefore continues after *any* crash — SIGKILL of every process included:

* weights, optimizer and policy version come from the newest checkpoint (none: the start);
* the trace is reopened and appended to (`TraceWriter.reopen` repairs a killed writer's
  tail); executions left open are recovered from the journal and their preserved
  workspaces scored like a timed-out execution's, or closed as unrecoverable with the
  reason; executions that never launched are closed as such;
* every dispatched group not trained by the checkpointed weights is carried into the new
  scheduler, ready, with its original dispatch version (`Start(carried=...)`), and trained.

Only work in flight is redone: the updates after the newest checkpoint (their groups are
carried again) and the rest of the executions that were running.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre import fsafe
from gyre.train import core_file
from gyre.train.core_file import CORE
from gyre.train.core_file import save as save_core

if TYPE_CHECKING:
    from gyre.runtime.shared.config import CheckpointConfig

EXIT_CHECKPOINTED = 75
"""Exit status of rank 0 after a checkpoint-and-exit (EX_TEMPFAIL): the job should be requeued."""
CHECKPOINTS = "checkpoints"
STATE = "state.json"
MADE_BY = "gyre checkpoint"  # the marker of a checkpoint directory (gyre.fsafe)
PREEMPT = threading.Event()  # set by the coordinator's SIGUSR1 handler

__all__ = ["CORE", "EXIT_CHECKPOINTED", "PREEMPT", "STATE", "CheckpointState", "Checkpoints",
           "begin", "commit", "latest", "load_core", "load_weights", "save_core"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """A checkpoint's driver state (its `state.json`): what the coordinator resumes from."""

    version: int  # the policy version of the saved weights
    updates: int  # optimizer updates done
    trained: tuple[str, ...]  # the groups those weights trained
    next_group: int  # the first unused group number (g<n>)
    t: float  # unix seconds it was committed

    def as_dict(self) -> dict[str, Any]:
        """The `state.json` object (keys as always written)."""
        return {**dataclasses.asdict(self), "trained": list(self.trained)}

    @classmethod
    def of(cls, data: dict[str, Any]) -> CheckpointState:
        """The state read back from a `state.json` object."""
        return cls(version=int(data["version"]), updates=int(data["updates"]),
                   trained=tuple(data["trained"]), next_group=int(data["next_group"]),
                   t=float(data["t"]))  # fmt: skip


class Checkpoints:
    """The coordinator's side: when a checkpoint is due, the one being written, its commit."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        # folder, updates done and groups trained by the weights being saved
        self.writing: tuple[Path, int, list[str]] | None = None
        self.last = time.time()
        self.updates: int | None = None  # of the newest checkpoint this job committed

    @property
    def enabled(self) -> bool:
        """Whether the run takes periodic checkpoints at all."""
        return self.cfg.every_steps > 0 or self.cfg.every_minutes > 0

    def due(self, updates: int) -> bool:
        """After update `updates`: whether `every_steps` or `every_minutes` asks for one."""
        c = self.cfg
        if self.writing is not None:
            return False  # one at a time
        by_steps = c.every_steps > 0 and updates % c.every_steps == 0
        by_time = c.every_minutes > 0 and time.time() - self.last >= 60 * c.every_minutes
        return by_steps or by_time

    def start(self, version: int, updates: int, trained: list[str]) -> Path:
        """The folder the core saves its weights into, after `updates` updates (their groups
        `trained`); `version` only names the folder while it is written."""
        folder = begin(self.run_dir, version)
        self.writing = (folder, updates, list(trained))
        return folder

    def finish(self, folder: str, version: int, next_group: int) -> Path:
        """The core saved `version` into `folder`: commit it with the driver state; its final
        path."""
        assert self.writing is not None and str(self.writing[0]) == folder
        written, updates, trained = self.writing
        state = CheckpointState(version=version, updates=updates, trained=tuple(trained),
                                next_group=next_group, t=time.time())  # fmt: skip
        final = commit(self.run_dir, written, state, self.cfg.keep)
        self.writing, self.last, self.updates = None, time.time(), updates
        return final


def begin(run_dir: Path, version: int) -> Path:
    """A fresh temporary directory for the checkpoint of `version` (renamed by `commit`)."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    return fsafe.make_temp_dir(f".v{version:05d}-", root)


def commit(run_dir: Path, folder: Path, state: CheckpointState, keep: int) -> Path:
    """Write the driver state, rename the checkpoint into place, prune to the newest `keep`."""
    (folder / STATE).write_text(json.dumps(state.as_dict()))
    final = run_dir / CHECKPOINTS / f"v{state.version:05d}"
    fsafe.adopt(final, MADE_BY, (CORE, STATE))  # an older Gyre's, written before markers
    fsafe.move_into_place(folder, final, MADE_BY)
    for old in _committed(run_dir)[:-keep]:
        fsafe.adopt(old, MADE_BY, (CORE, STATE))
        if fsafe.maker_of(old) == MADE_BY:  # one without the marker is not Gyre's to remove
            fsafe.remove_tree(old, MADE_BY, ignore_errors=True)
    return final


def _committed(run_dir: Path) -> list[Path]:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.name.startswith("v") and (d / STATE).exists())


def latest(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """(directory, driver state) of the newest complete checkpoint, or None."""
    done = _committed(run_dir)
    if not done:
        return None
    return done[-1], json.loads((done[-1] / STATE).read_text())


def load_core(run_dir: Path) -> dict[str, Any] | None:
    """The newest checkpoint's core file (`version`, `named`, `optimizer`), or None."""
    found = latest(run_dir)
    return None if found is None else core_file.load(found[0])


def load_weights(run_dir: Path) -> list[tuple[str, Any]] | None:
    """The newest checkpoint's main weights (HF layout), its optimizer state left unread;
    None without a checkpoint."""
    found = latest(run_dir)
    return None if found is None else core_file.weights(found[0])
