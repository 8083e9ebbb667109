"""Megatron-core training backend (GPU clusters; optional extra ``gyre[gpu]``).

* `config` — `MegatronConfig` and the Hugging Face (Qwen2, Llama, Qwen3, Qwen3-MoE,
  Qwen2-MoE) → `TransformerConfig` mapping (torch-free);
* `weights` — name and layout conversion between Hugging Face / rollout-engine tensors and
  Megatron's fused QKV and gate-up tensors, with tensor-parallel sharding;
* `groups` — the K−1 prefix process groups (NCCL) over a cell's parallel layout, matching
  the MPI prefix communicators of `gyre.train.comm`;
* `model` — `build_rank_model` (each rank's shard built on its own device: seeded as
  Megatron requires on CUDA, patched on the CPU) and `MegatronCell`, a drop-in for
  `gyre.train.cell.TorchCell` (same micro-step stream, objective and flat buffers);
* `attention` — `SDPAttention`, the layer spec's core attention on torch's fused
  scaled-dot-product kernels (memory linear in the row);
* `pipeline` — a micro-step's forward and backward stage by stage (pipeline parallelism);
* `cpu` — the six scoped patches that let megatron-core's forward and backward run on the
  CPU (applied for a model on the CPU only, never on the CUDA path).

`gyre run` uses it through `train.backend: megatron` (`gyre.train.backends.megatron`).

See docs/gpu.md.
"""
