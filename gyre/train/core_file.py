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
reads one file per rank (`read_shard`); a Megatron core at other sizes splits its shard
from the files a layer at a time (`source`); `load` reassembles the whole HF layout from
every shard (`stages_to_hf`) for a reader that needs it: a torch core, `gyre eval`. So a checkpoint taken with either backend resumes with the other, at any tensor /
pipeline sizes and either `train.dtype`: it holds the optimizer's main weights, not the bf16
parameters, so a resume continues bit for bit. Torch is imported only when a file is written
or read.

    size = save(folder, named, optimizer_state, version)
    size = save_shard(folder, shard, {"main": flat, "exp_avg": m, ...}, meta)
    data = load(folder)            # {"version", "named", "optimizer"}, from either form
    hf = assembled(folder, "main") # one buffer of a sharded one, in the HF layout
    src = source(folder, "main")   # the same, read a layer at a time (a TensorSource)
    named = weights(folder)        # the main weights alone, from either form
"""

from __future__ import annotations

import json
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

    if _sharded(folder):
        return _assemble(folder)
    return dict(torch.load(folder / CORE, weights_only=True))


def _sharded(folder: Path) -> bool:
    """Whether checkpoint directory `folder` holds a Megatron core's shards (not a core file)."""
    return not (folder / CORE).exists() and (folder / SHARDS).is_dir()


def weights(folder: Path) -> list[tuple[str, Any]]:
    """The main weights of checkpoint directory `folder` in the HF layout and order, without
    its optimizer state (what a standalone engine loads on a resume): a sharded checkpoint's
    main buffers alone, a core file mapped so that its moments are never read."""
    import torch

    if _sharded(folder):
        main, first = assembled(folder, "main"), shard_meta(folder)
        assert first is not None
        return [(n, main[n]) for n in first["hf_order"]]
    data = torch.load(folder / CORE, weights_only=True, mmap=True)
    return [(n, t.clone()) for n, t in data["named"]]  # read now, the file unmapped after


def _shard_path(folder: Path, shard: int) -> Path:
    return folder / SHARDS / f"rank-{shard:05d}.safetensors"


def save_shard(folder: Path, shard: int, flats: dict[str, Any], meta: dict[str, Any]) -> int:
    """Rank `shard`'s flat buffers (each a 1-D tensor in its parameter order; `step` a
    scalar) and their JSON description into checkpoint directory `folder`; bytes."""
    from safetensors.torch import save_file

    path = _shard_path(folder, shard)
    path.parent.mkdir(exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in flats.items()}, str(path),
              metadata={SHARD_KEY: json.dumps(meta)})  # fmt: skip
    return path.stat().st_size


def shard_meta(folder: Path, shard: int = 0) -> dict[str, Any] | None:
    """Rank `shard`'s description in a sharded checkpoint (None: not a sharded one)."""
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


def offsets(names: Sequence[Sequence[Any]]) -> dict[str, tuple[int, int, list[int]]]:
    """Where each (name, shape) of `names` lies in their flat buffer, laid end to end in
    order: name -> (start, stop, shape)."""
    import math

    out, off = {}, 0
    for name, shape in names:
        out[name] = (off, off + math.prod(shape), list(shape))
        off += math.prod(shape)
    return out


def views(flat: Any, names: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """A flat buffer's slice of each (name, shape) of `names`, in order, by name."""
    return {name: flat[a:b].view(shape) for name, (a, b, shape) in offsets(names).items()}


def shard_keys(folder: Path) -> set[str]:
    """The flat buffers a sharded checkpoint's files hold (rank 0's: every rank's are alike)."""
    from safetensors import safe_open

    with safe_open(str(_shard_path(folder, 0)), framework="pt") as f:
        return set(f.keys())


def assembled(folder: Path, key: str) -> dict[str, Any]:
    """One flat buffer (`key`: "main", "exp_avg", "exp_avg_sq") of every shard of a sharded
    checkpoint, put together in the HF layout and named as the model names its parameters.
    Only that buffer is read from each file: a reader that takes the keys one at a time holds
    one model-sized state at once (and that state's shards while it is put together), not
    the three a checkpoint holds."""
    from safetensors import safe_open

    from gyre.train.megatron.weights import WeightLayout, module_names, stages_to_hf

    first = shard_meta(folder)
    if first is None:
        raise FileNotFoundError(_shard_path(folder, 0))
    stages = []
    for shard in range(first["tensor"] * first["pipeline"]):
        with safe_open(str(_shard_path(folder, shard)), framework="pt") as f:
            meta = json.loads(f.metadata()[SHARD_KEY])
            stages.append(views(f.get_tensor(key), meta["names"]))
    layout = WeightLayout(**first["layout"])
    return module_names(stages_to_hf(stages, layout, tp_size=first["tensor"]), layout)


def source(folder: Path, key: str) -> Any:
    """One flat buffer (`key`) of a sharded checkpoint as a `TensorSource` of HF tensors
    (`gyre.train.megatron.weights.ShardedSource`), put together a layer at a time from only
    that layer's ranges of the files that hold it: what a Megatron rank resuming at other
    sizes splits to its own shard, never holding the whole model's buffer."""
    from safetensors import safe_open

    from gyre.train.megatron.weights import ShardedSource, WeightLayout

    first = shard_meta(folder)
    if first is None:
        raise FileNotFoundError(_shard_path(folder, 0))
    shards = first["tensor"] * first["pipeline"]
    where = []  # per shard: name -> (start, stop, shape) in its flat buffers
    for shard in range(shards):
        meta = shard_meta(folder, shard)
        assert meta is not None
        where.append(offsets(meta["names"]))

    def read(shard: int, names: Sequence[str]) -> dict[str, Any]:
        with safe_open(str(_shard_path(folder, shard)), framework="pt") as f:
            flat = f.get_slice(key)
            out = {}
            for name in names:
                a, b, shape = where[shard][name]
                out[name] = flat[a:b].view(shape)
            return out

    return ShardedSource(WeightLayout(**first["layout"]), tp_size=first["tensor"],
                         stages=first["pipeline"], names=[list(at) for at in where],
                         read=read)  # fmt: skip


def shard_step(folder: Path) -> Any:
    """AdamW's step of a sharded checkpoint (every rank's is the same)."""
    from safetensors import safe_open

    with safe_open(str(_shard_path(folder, 0)), framework="pt") as f:
        return f.get_tensor("step")


def _assemble(folder: Path) -> dict[str, Any]:
    """The HF-layout core state of a sharded checkpoint (every shard read, a key at a time)."""
    import torch

    first = shard_meta(folder)
    assert first is not None
    order = first["hf_order"]
    main = assembled(folder, "main")
    optimizer = None
    if "exp_avg" in shard_keys(folder):
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            hf = assembled(folder, key)
            moments[key] = torch.cat([hf[n].reshape(-1) for n in order])
            del hf
        optimizer = {"state": {0: {"step": shard_step(folder), **moments}},
                     "param_groups": first["param_groups"]}  # fmt: skip
    return {
        "version": first["version"],
        "named": [(n, main[n]) for n in order],
        "optimizer": optimizer,
    }
