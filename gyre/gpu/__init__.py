"""CUDA paths: device placement and dtypes, memory measurement, pinned host snapshots,
role-switch release of a training cell, and the embedded engine on a GPU.

* `memory` — `Placement` (device + dtype), `memory_stats`, `measure` (seconds and device
  memory around an action, after `torch.cuda.empty_cache`);
* `snapshot` — `PinnedSnapshot` (host mirror of a device buffer in page-locked memory) and
  `CellOffload` (a `TorchCell`'s flat buffers to host and back: the training→rollout release);
* `engine` — `python -m gyre.gpu.engine --device cuda --dtype bfloat16 ...`: the embedded
  engine serving the same protocol on CUDA, with memory release that frees device memory.

Everything here also runs on CPU (no pinning, no cache to empty), which is what CI tests.
"""
