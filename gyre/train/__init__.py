"""The training plane: from scored executions to one optimizer update per batch.

* `config`    — `TrainConfig` and its parts (torch-free).
* `rewards`   — execution outcomes, group readiness, group-relative advantages.
* `admission` — the §5.3 admission rule: at most `J_max` trajectories per execution by role
  priority, shared targets counted once (pure, seeded).
* `packing`   — token rows with targets, behaviour log-probs and weights; micro-steps.
* `objective` — the execution-level GSPO adaptation (docs/objective.md).
* `stream`    — the stream packing buffer and the shared micro-step queue.
* `cell`      — a torch training cell: forwards, backwards, gradient buffers, the core's Adam.
* `comm`      — communicators (world, per cell, prefix sets), gradient sum, parameter broadcast.
* `transfer`  — weight snapshots core -> satellites over Mooncake (TCP) or MPI.
* `backends`  — the training backends (torch, megatron) by `train.backend`: one record each,
  one registry; each builds a cell rank's replica.
* `core_file` — a checkpoint's core file: the core's weights and AdamW state (HF layout).
* `world`     — one streaming batch driven across an MPI world (coordinator + cells).

Pure modules (config, rewards, admission, packing, stream) import no torch; docs/training.md describes the
trainer and how the coordinator drives it.
"""
