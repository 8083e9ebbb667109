"""A model directory's safetensors files as a `TensorSource`: each rank reads only its slice.

A Megatron rank needs its tensor-parallel chunk of its pipeline stage's tensors, not the
whole model (`gyre.train.megatron.weights`). safetensors files are read lazily: a file's
header names each tensor's dtype, shape and byte range, and `safe_open(path, "pt")
.get_slice(name)[rows]` maps the file and copies out only the rows asked for. A checkpoint
of one file is ``model.safetensors``; a sharded one has ``model.safetensors.index.json``,
whose ``weight_map`` names each tensor's file. So a rank of a 70B model at TP 8 holds an
eighth of each of its stage's tensors, one tensor of the file mapped at a time.

    files = SafetensorsFiles.find("/models/Qwen2.5-7B")       # None: no safetensors there
    shard = stage_to_mcore(files, layout, tp_rank=1, tp_size=2, stage=0, stages=1)

Tensors come back in the file's dtype (a loader's copy into the model casts them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gyre.errors import TrainingError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class SafetensorsFiles:
    """The tensors of a model directory's safetensors files, read chunk by chunk."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        if not ((folder / INDEX).is_file() or (folder / SINGLE).is_file()):
            raise TrainingError(f"model directory {folder}: no {SINGLE} nor {INDEX} here (every "
                                "rank of a cell reads the directory at the same path)")  # fmt: skip
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE]
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:  # the headers only: no tensor bytes are read here
            with safe_open(folder / name, "pt") as f:
                for key in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                    self.file_of[key] = folder / name
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    @classmethod
    def find(cls, model: str) -> SafetensorsFiles | None:
        """The files of model directory `model`; None where it is not a directory of
        safetensors (a built-in model, a directory of ``.bin`` files)."""
        folder = Path(model)
        return cls(folder) if (folder / INDEX).is_file() or (folder / SINGLE).is_file() else None

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise TrainingError(f"hf weights: {name!r} missing in the safetensors files of "
                                f"{self.folder}")  # fmt: skip
        return self.shapes[name]

    def chunk(self, name: str, dim: int, rank: int, size: int) -> torch.Tensor:
        """Rows `rank`/`size` along `dim`, copied out of the file's mapping (which closes
        here: a slice along dim 1 touches every page of its tensor, and those pages leave
        this process's resident memory with the mapping)."""
        from safetensors import safe_open

        n = self.shape(name)[dim] // size
        index = (slice(None),) * dim + (slice(rank * n, (rank + 1) * n),)
        with safe_open(self.file_of[name], "pt") as f:
            view = f.get_slice(name)[index]  # a view of the mapped file
            return view.clone(memory_format=torch.contiguous_format)
