"""CUDA paths: device placement and dtypes, memory measurement, and the embedded engine on
a GPU (a training cell's release on a role switch is `gyre.runtime.cell.residency`).

* `memory` — `Placement` (device + dtype), `memory_stats`, `measure` (seconds and device
  memory around an action, after `torch.cuda.empty_cache`);
* `engine` — `python -m gyre.gpu.engine --device cuda --dtype bfloat16 ...`: the embedded
  engine serving the same protocol on CUDA, with memory release that frees device memory.

Everything here also runs on CPU (no pinning, no cache to empty), which is what CI tests.
"""
