"""Preemption: checkpoint at SIGUSR1, exit for requeue, resume from the same run directory.

Slurm signals every task (`--signal=USR1@T`); only the coordinator acts on it (the other
ranks ignore SIGUSR1). At the next message boundary the coordinator stops starting work,
cancels the running harnesses and still closes, scores and records them, asks the core to
save its weights and optimizer state (`checkpoint.pt`), writes the driver state
(`checkpoint.json`: updates done, policy version), closes the trace and stops every rank
with `EXIT_CHECKPOINTED` (the Slurm launcher's requeue status). A job started again with
the same run directory resumes: every replica and engine loads the checkpoint weights, the
core its optimizer, and the scheduler starts from that policy version; the resumed segment
writes `trace.<n>.h5` next to the first trace. Groups that were ready but not yet trained
at the checkpoint are recorded in the trace and not carried over.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from gyre.launch.task import EXIT_CHECKPOINTED

WEIGHTS = "checkpoint.pt"
STATE = "checkpoint.json"
PREEMPT = threading.Event()  # set by the coordinator's SIGUSR1 handler

__all__ = ["EXIT_CHECKPOINTED", "PREEMPT", "load_state", "restore_replica", "save_core",
           "save_state", "trace_path"]  # fmt: skip


def load_state(run_dir: Path) -> dict[str, Any] | None:
    """The driver state of a checkpoint in `run_dir`, or None for a fresh run."""
    path = run_dir / STATE
    return json.loads(path.read_text()) if path.exists() else None


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(run_dir / STATE)


def trace_path(run_dir: Path) -> Path:
    """`trace.h5` for a fresh run, `trace.<n>.h5` for the n-th resumed segment."""
    path, n = run_dir / "trace.h5", 1
    while path.exists():
        path, n = run_dir / f"trace.{n}.h5", n + 1
    return path


def save_core(run_dir: Path, named: list, optimizer: Any, version: int) -> None:
    """The core's weights and AdamW state, written atomically."""
    import torch

    tmp = run_dir / (WEIGHTS + ".tmp")
    opt = optimizer.opt.state_dict() if optimizer is not None else None
    torch.save({"version": version, "named": named, "optimizer": opt}, tmp)
    tmp.replace(run_dir / WEIGHTS)


def restore_replica(run_dir: Path, model: Any, optimizer: Any) -> int:
    """Load checkpoint weights (and, on the core, the optimizer) in place; returns the version."""
    import torch

    from gyre.rollout.weights import load_named_tensors

    path = run_dir / WEIGHTS
    if not path.exists():
        return 0
    data = torch.load(path, weights_only=True)
    load_named_tensors(model, data["named"])
    if optimizer is not None and data["optimizer"] is not None:
        optimizer.opt.load_state_dict(data["optimizer"])
    return int(data["version"])
