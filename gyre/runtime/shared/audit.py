"""Batch audits (`train.record_batches: true`): what every update was computed from.

The coordinator writes each batch's micro-steps, execution table, E and who computed which
pass (`RUN_DIR/batches/b<batch>-steps.pt`); the core writes the weights the batch was
computed at, the summed gradient it received and the weights after its update
(`b<batch>-core.pt`). Anyone can then recompute an update in one process and compare — the
runtime's invariance test does exactly that. Files are `torch.save` dicts of tensors, numpy
arrays and plain values (`torch.load(path, weights_only=False)`); they are large, so the
switch is off by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

AUDIT_DIR = "batches"


def _path(run_dir: Path, name: str) -> Path:
    folder = run_dir / AUDIT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def record_steps(run_dir: Path, batch: int, content: dict[str, Any]) -> None:
    """Coordinator: the batch's micro-steps, executions, E and pass assignment."""
    import torch

    torch.save(content, _path(run_dir, f"b{batch:05d}-steps.pt"))


def record_update(run_dir: Path, batch: int, content: dict[str, Any]) -> None:
    """Core: weights before, summed gradient, gradient norm and weights after the update."""
    import torch

    torch.save(content, _path(run_dir, f"b{batch:05d}-core.pt"))


def load(run_dir: Path, batch: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(steps record, core record) of one batch. The core record is None for a batch that
    had nothing to train (`num_executions` 0: every group set aside; the core skipped its
    update and wrote none); a trained batch without one is an error (FileNotFoundError)."""
    import torch

    folder = run_dir / AUDIT_DIR
    steps = torch.load(folder / f"b{batch:05d}-steps.pt", weights_only=False)
    if steps["num_executions"] == 0:
        return steps, None
    core = torch.load(folder / f"b{batch:05d}-core.pt", weights_only=False)
    return steps, core
