"""Megatron-core training backend (GPU clusters; optional extra ``gyre[gpu]``).

* `config` — `MegatronConfig` and the Hugging Face (Qwen2 / Llama) → `TransformerConfig`
  mapping (torch-free);
* `weights` — name and layout conversion between Hugging Face / rollout-engine tensors and
  Megatron's fused QKV and gate-up tensors, with tensor-parallel sharding;
* `groups` — the K−1 prefix process groups (NCCL) over a cell's parallel layout, matching
  the MPI prefix communicators of `gyre.train.comm`;
* `model` — `build_gpt_model` and `MegatronCell`, a drop-in for `gyre.train.cell.TorchCell`
  (same micro-step stream, objective and flat buffers);
* `pipeline` — a micro-step's forward and backward stage by stage (pipeline parallelism);
* `cpu` — the four scoped patches that let megatron-core's forward and backward run on a
  machine without CUDA (inactive where CUDA is present).

`gyre run` uses it through `train.backend: megatron` (`gyre.train.backends.megatron`).

See docs/gpu.md.
"""
