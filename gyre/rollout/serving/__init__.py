"""Engine servers as Gyre runs them: SGLang's or the embedded engine (one HTTP protocol).

* `config` — `ServerConfig` and the launch command (`sglang` or `embedded` preset, or a
  template), torch-free;
* `process` — `EngineProcess`: start a server from its config, wait for `/health`, stop it;
* `nccl` — the trainer's side of `update_weights_from_distributed`: a standalone process
  group shared with the engines' ranks and the per-tensor broadcast.

A running server is driven through `gyre.rollout.client.EngineClient`: role switches
(`release_procedure`, `resume_procedure`), reroutes (`abort_all`), weight publication
(`update_weights_from_tensor`, or `init_update_group` + `update_weights_from_distributed`)
and `confirm_version` (`/model_info`). See docs/gpu.md.
"""
