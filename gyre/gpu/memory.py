"""Device placement, dtypes and measured memory release.

    place = Placement(device="cuda", dtype="bfloat16")
    model = place.apply(model)
    report = measure(lambda: offload.release(cell), place.device)
    report.seconds, report.before["allocated"], report.after["allocated"]

`memory_stats` reports bytes allocated / reserved by PyTorch's caching allocator and the
device's free / total memory (`torch.cuda.mem_get_info`); on CPU all four are 0. `measure`
runs the action, collects garbage, empties the CUDA cache and synchronizes before reading
"after", so the numbers are what another process on the GPU could now use.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gyre.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True)
class Placement:
    """Where a model lives and in which dtype."""

    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16."""

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device: {self.device!r}; allowed cpu, cuda, cuda:N")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r}; allowed {', '.join(DTYPES)}")
        if self.device != "cpu" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device!r} but CUDA is not available here")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move `model` to the device and dtype (in place; returned for chaining)."""
        return model.to(device=self.device, dtype=self.torch_dtype)


def memory_stats(device: str | torch.device = "cuda") -> dict[str, int]:
    """Allocator and device memory in bytes (zeros on CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"allocated": 0, "reserved": 0, "free": 0, "total": 0}
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    return {
        "allocated": int(torch.cuda.memory_allocated(dev)),
        "reserved": int(torch.cuda.memory_reserved(dev)),
        "free": int(free),
        "total": int(total),
    }


@dataclass(slots=True)
class MemoryReport:
    """An action's wall time and the memory before and after it."""

    seconds: float
    before: dict[str, int]
    after: dict[str, int]
    result: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "before": self.before, "after": self.after}


def release_cached(device: str | torch.device = "cuda") -> None:
    """Collect garbage and return PyTorch's cached, unused blocks to the device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(action: Callable[[], Any], device: str | torch.device = "cuda") -> MemoryReport:
    """Run `action`, release cached memory, report seconds and memory before / after."""
    before = memory_stats(device)
    t0 = time.perf_counter()
    result = action()
    release_cached(device)
    seconds = time.perf_counter() - t0
    return MemoryReport(seconds=seconds, before=before, after=memory_stats(device), result=result)
