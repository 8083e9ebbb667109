"""The core file of a checkpoint: the core's weights and AdamW state, whatever the backend.

A checkpoint directory (`gyre.runtime.shared.checkpoint` owns those: begin, commit, the
newest, how many are kept) holds the core's state in one of two forms. A torch core's leader
writes one core file, `core.pt`, read back by every cell rank on a resume:

    {"version": int,                       # the policy version of the weights
     "named": [(name, tensor), ...],       # the main weights (float32 under mixed
                                           # precision), in the Hugging Face layout
     "optimizer": AdamW state dict | None} # moments in the HF model's flat order

A Megatron core's ranks each write their own shard, in parallel, nothing gathered:
`shards/rank-<s>.safetensors` holds rank s's flat buffers — main weights, both AdamW moments
(its shard of its stage, Megatron's parameter order) and AdamW's step — with a JSON header
(`SHARD_KEY`) naming each parameter and shape in that order, the cell's tensor and pipeline
sizes, the weight layout (`gyre.train.megatron.weights.WeightLayout`, the expert-parallel
size included) and the optimizer's
hyperparameters; rank 0's also the Hugging Face parameter order. A resume at the same sizes
reads one file per rank (`read_shard`); `load` reassembles the HF layout from every shard
(`stages_to_hf`) for any other reader: a Megatron core at other sizes, a torch core, `gyre
eval`. So a checkpoint taken with either backend resumes with the other, at any tensor /
pipeline sizes and either `train.dtype`: it holds the optimizer's main weights, not the bf16
parameters, so a resume continues bit for bit. Torch is imported only when a file is written
or read.

    size = save(folder, named, optimizer_state, version)
    size = save_shard(folder, shard, {"main": flat, "exp_avg": m, ...}, meta)
    data = load(folder)            # {"version", "named", "optimizer"}, from either form
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

CORE = "core.pt"
"""The core file's name inside a checkpoint directory."""
SHARDS = "shards"
"""The folder of a Megatron core's per-rank files inside a checkpoint directory."""
SHARD_KEY = "gyre"
"""The safetensors header entry holding a shard's JSON description."""


def save(folder: Path, named: list[tuple[str, Any]], opt: dict[str, Any] | None,
         version: int) -> int:  # fmt: skip
    """The core's weights and AdamW state dict into checkpoint directory `folder`; bytes."""
    import torch

    torch.save({"version": version, "named": named, "optimizer": opt}, folder / CORE)
    return (folder / CORE).stat().st_size


def load(folder: Path) -> dict[str, Any]:
    """The core state of checkpoint directory `folder` (`version`, `named`, `optimizer`), in
    the HF layout: its core file, or its shards put together."""
    import torch

    if not (folder / CORE).exists() and (folder / SHARDS).is_dir():
        return _assemble(folder)
    return dict(torch.load(folder / CORE, weights_only=True))


def _shard_path(folder: Path, shard: int) -> Path:
    return folder / SHARDS / f"rank-{shard:05d}.safetensors"


def save_shard(folder: Path, shard: int, flats: dict[str, Any], meta: dict[str, Any]) -> int:
    """Rank `shard`'s flat buffers (each a 1-D tensor in its parameter order; `step` a
    scalar) and their JSON description into checkpoint directory `folder`; bytes."""
    import json

    from safetensors.torch import save_file

    path = _shard_path(folder, shard)
    path.parent.mkdir(exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in flats.items()}, str(path),
              metadata={SHARD_KEY: json.dumps(meta)})  # fmt: skip
    return path.stat().st_size


def shard_meta(folder: Path, shard: int = 0) -> dict[str, Any] | None:
    """Rank `shard`'s description in a sharded checkpoint (None: not a sharded one)."""
    import json

    from safetensors import safe_open

    path = _shard_path(folder, shard)
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        return dict(json.loads(f.metadata()[SHARD_KEY]))


def read_shard(folder: Path, shard: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank `shard`'s flat buffers and description."""
    from safetensors.torch import load_file

    meta = shard_meta(folder, shard)
    if meta is None:
        raise FileNotFoundError(_shard_path(folder, shard))
    return load_file(str(_shard_path(folder, shard))), meta


def expert(meta: dict[str, Any]) -> int:
    """The expert-parallel size a shard was written at (1 before expert parallelism)."""
    return int(meta["layout"].get("expert_parallel", 1))


def views(flat: Any, names: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """A flat buffer's slice of each (name, shape) of `names`, in order, by name."""
    import math

    out, off = {}, 0
    for name, shape in names:
        n = math.prod(shape)
        out[name] = flat[off : off + n].view(shape)
        off += n
    return out


def _assemble(folder: Path) -> dict[str, Any]:
    """The HF-layout core state of a sharded checkpoint (every shard read)."""
    import torch

    from gyre.train.megatron.weights import WeightLayout, module_names, stages_to_hf

    first = shard_meta(folder)
    assert first is not None
    ranks = [read_shard(folder, s) for s in range(first["tensor"] * first["pipeline"])]
    layout = WeightLayout(**first["layout"])

    def hf(key: str) -> dict[str, torch.Tensor]:  # named as the HF model's parameters are
        return module_names(stages_to_hf([views(flats[key], meta["names"])
                                          for flats, meta in ranks], layout,
                                         tp_size=first["tensor"]), layout)  # fmt: skip

    order = first["hf_order"]
    main = hf("main")
    optimizer = None
    if "exp_avg" in ranks[0][0]:
        moments = {k: torch.cat([t[n].reshape(-1) for n in order])
                   for k, t in (("exp_avg", hf("exp_avg")), ("exp_avg_sq", hf("exp_avg_sq")))}  # fmt: skip
        optimizer = {"state": {0: {"step": ranks[0][0]["step"], **moments}},
                     "param_groups": first["param_groups"]}  # fmt: skip
    return {
        "version": first["version"],
        "named": [(n, main[n]) for n in order],
        "optimizer": optimizer,
    }
