"""SGLang engine management for GPU cells (the embedded engine speaks the same protocol).

* `config` — `ServerConfig` and the launch command (`sglang` or `embedded` preset, or a
  template), torch-free;
* `process` — `EngineProcess`: start a server from its config, wait for `/health`, stop it;
* `control` — `ManagedEngine`: role switches (pause, then `/release_memory_occupation`;
  `/resume_memory_occupation`, then continue), reroute (`/abort_request`), weight
  publication inside a weight-update session (`/update_weights_from_tensor`,
  `/init_weights_update_group` + `/update_weights_from_distributed`) with `weight_version`
  tracking (`/model_info`);
* `nccl` — the trainer's side of `update_weights_from_distributed`: a standalone process
  group shared with the engines' ranks and the per-tensor broadcast.

See docs/gpu.md.
"""
