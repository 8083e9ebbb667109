"""The core file of a checkpoint: the core's weights and AdamW state, whatever the backend.

A checkpoint directory (`gyre.runtime.shared.checkpoint` owns those: begin, commit, the
newest, how many are kept) holds one core file, `core.pt`, written by the core's leader
and read back by every cell rank on a resume:

    {"version": int,                       # the policy version of the weights
     "named": [(name, tensor), ...],       # the main weights (float32 under mixed
                                           # precision), in the Hugging Face layout
     "optimizer": AdamW state dict | None} # moments in the HF model's flat order

Both backends write and read the same file (a Megatron core gathers its shards into the HF
layout and splits them again on load), so a checkpoint taken with one resumes with the
other, at any tensor / pipeline sizes and either `train.dtype`: it holds the optimizer's
main weights, not the bf16 parameters, so a resume continues bit for bit. Torch is imported only when a file is written or read.

    size = save(folder, named, optimizer_state, version)
    data = load(folder)            # {"version", "named", "optimizer"}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORE = "core.pt"
"""The core file's name inside a checkpoint directory."""


def save(folder: Path, named: list[tuple[str, Any]], opt: dict[str, Any] | None,
         version: int) -> int:  # fmt: skip
    """The core's weights and AdamW state dict into checkpoint directory `folder`; bytes."""
    import torch

    torch.save({"version": version, "named": named, "optimizer": opt}, folder / CORE)
    return (folder / CORE).stat().st_size


def load(folder: Path) -> dict[str, Any]:
    """The core file of checkpoint directory `folder` (`version`, `named`, `optimizer`)."""
    import torch

    return dict(torch.load(folder / CORE, weights_only=True))
