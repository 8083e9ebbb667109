"""Fixtures of the GPU-backend tests: what runs on CPU here, and CUDA-only skips.

`cuda` skips a test with a clear reason when no CUDA device is present (CI has none);
`megatron_world` initializes a one-rank gloo world with Megatron's parallel_state (TP = PP = 1)
for the test module and tears it down afterwards.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run tools/gpu_check.sh on a GPU machine)")
    return "cuda"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra gyre[gpu])")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import init_model_parallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    init_model_parallel(MegatronConfig(dtype="float32"), "cpu")
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
