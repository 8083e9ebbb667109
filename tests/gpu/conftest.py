"""Fixtures of the GPU-backend tests: what runs on CPU here, and CUDA-only skips.

`cuda` skips a test with a clear reason when no CUDA device is present (CI has none);
`megatron_world` initializes a one-rank gloo world with Megatron's parallel_state (TP = PP = 1)
for the test module and tears it down afterwards. `workers` starts the processes of the
multi-rank worlds (gloo or mpiexec) as forks of one process per test process that has
imported what `gyre run`'s rank zygote imports for Megatron cells (`gyre.runtime.main.preload`:
torch, megatron-core as Gyre imports it, Gyre's Megatron model) — a rank zygote, as `gyre
run`'s ranks are forked (`gyre.zygote`) — instead of new interpreters that import them again.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from gyre import zygote
from gyre.train.megatron.model import import_megatron

with contextlib.suppress(ImportError):  # not installed: the fixtures below say so
    import_megatron()  # before any test module here imports megatron-core: as a rank does


@pytest.fixture
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run tools/gpu_check.sh on a GPU machine)")
    return "cuda"


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra gyre[gpu])")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import init_model_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(MegatronConfig(dtype="float32"), "cpu")
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@dataclass(frozen=True)
class Workers:
    """How a test starts a worker: `command(SCRIPT, *args)` with `env()` (a new interpreter
    running ``python SCRIPT ARGS``, forked from the zygote at `address`)."""

    address: str

    def command(self, script: object, *args: object) -> list[str]:
        return [sys.executable, "-m", "gyre.zygote", str(script), *map(str, args)]

    def env(self) -> dict[str, str]:
        return {**os.environ, zygote.ENV: self.address}


@pytest.fixture(scope="session")
def workers() -> Iterator[Workers]:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra gyre[gpu])")
    # what `gyre run`'s rank zygote imports for Megatron cells, as it imports it
    warm = zygote.serve_ranks("gyre.runtime.main:preload", "megatron", ranks=1 << 30,
                              env=dict(os.environ))  # fmt: skip
    try:
        yield Workers(warm.address)
    finally:
        warm.close()
