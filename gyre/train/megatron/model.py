"""Megatron-core policy model and the training cell that runs it.

`build_gpt_model(hf_config, cfg)` builds a `GPTModel` (local layer spec: plain torch modules,
no Transformer Engine needed) from a Hugging Face Qwen2 / Llama config dict; Megatron's
`parallel_state` must be initialized first (`init_model_parallel`). `MegatronCell` is a
`gyre.train.cell.TorchCell` over that model: the same flat parameter / gradient buffers,
phase-A prepass and phase-B accumulate of the same micro-steps and objective, so the world
protocol (`gyre.runtime.coordinator.training`, docs/training.md) and transports work unchanged. With
tensor parallelism the logits are vocabulary-sharded and target log-probs come from
Megatron's vocab-parallel cross-entropy; with pipeline parallelism a micro-step runs stage by
stage (`gyre.train.megatron.pipeline`) and every stage gets the last stage's log-probs.
`ModelParallelOptimizer` is the core's optimizer: AdamW on each rank's shard, with the
global gradient norm summed over the cell's model-parallel group (replicated parameters and
the last stage's copy of a tied embedding counted once), so clipping matches a
single-device run.

On a machine without CUDA, `init_model_parallel` applies the four scoped patches of
`gyre.train.megatron.cpu` (megatron-core calls `torch.cuda` at four points even with every
fusion off), so forward and backward run on CPU too; with CUDA it changes nothing.

    init_model_parallel(cfg)                  # after torch.distributed.init_process_group
    model = build_gpt_model(hf_config, cfg, device="cuda")
    cell = MegatronCell(model, objective=ObjectiveConfig())
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from gyre.train.cell import CoreOptimizer, TorchCell, main_dtype
from gyre.train.config import ObjectiveConfig, OptimConfig
from gyre.train.megatron.config import MegatronConfig, gpt_kwargs, transformer_kwargs
from gyre.train.objective import check_finite, step_tensors, target_logprobs
from gyre.train.packing import MicroStep


def init_model_parallel(cfg: MegatronConfig) -> None:
    """Megatron's parallel_state over the current torch.distributed world (TP × PP inside a cell).

    Cell ranks must be contiguous in the torch.distributed numbering (`GroupLayout.dist_rank`);
    data parallelism then runs across cells.
    """
    _import_megatron()
    from megatron.core import parallel_state

    from gyre.train.megatron import cpu

    if not parallel_state.model_parallel_is_initialized():
        # "pp" before "dp": a cell's TP x PP ranks are contiguous, shard s = TP rank s % TP of
        # stage s // TP (Megatron's default order puts the pipeline outermost, across cells)
        parallel_state.initialize_model_parallel(
            cfg.tensor_parallel, cfg.pipeline_parallel, order="tp-cp-ep-pp-dp"
        )
    cpu.enable()  # CPU only: Megatron's four CUDA-only points (gyre.train.megatron.cpu)


def _import_megatron() -> None:
    """Import megatron-core, without the wandb it imports for logging Gyre never asks of it.

    megatron-core imports wandb at module level where it is installed (its timers and
    inference contexts could log to it): ~0.7 CPU-s on every Megatron rank of a start, and
    wandb is installed for the coordinator's tracker. A `None` entry in `sys.modules` makes
    that import fail as if wandb were absent, which megatron-core handles; the entry is
    removed afterwards, so wandb stays importable in this process. Where wandb or megatron-core
    is already imported this changes nothing.
    """
    if "megatron.core" in sys.modules or "wandb" in sys.modules:
        return
    sys.modules["wandb"] = None  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
    finally:
        if sys.modules.get("wandb", "") is None:
            del sys.modules["wandb"]


def build_gpt_model(
    hf_config: Mapping[str, Any], cfg: MegatronConfig, *, device: str = "cuda"
) -> torch.nn.Module:
    """A random-init GPTModel for this rank's TP shard / pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, cfg.dtype)
    tc = TransformerConfig(
        **transformer_kwargs(hf_config, cfg),
        activation_func=torch.nn.functional.silu,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # of the hidden states sent between stages
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device == "cpu",
        perform_initialization=True,
    )
    if device != "cpu":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    model = GPTModel(
        tc,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **gpt_kwargs(hf_config),
    )
    return model.to(device=device, dtype=dtype)


def _tp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_world_size())


class MegatronCell(TorchCell):
    """A cell rank running its tensor-parallel shard of one pipeline stage of a GPTModel.

    Every rank runs every row. With pipeline stages (`gyre.train.megatron.pipeline`) a
    micro-step's forward runs stage by stage, every stage gets the last stage's log-probs,
    and `_backward` sends the input gradients back stage by stage."""

    def __init__(self, model: torch.nn.Module, *, objective: ObjectiveConfig) -> None:
        from gyre.train.megatron.pipeline import Stage

        super().__init__(model, objective=objective)
        self.stage = Stage.current()
        # this stage's (received input, output) of the latest forward with grad: the backward's
        self._io: tuple[torch.Tensor | None, torch.Tensor] | None = None

    def free_scratch(self) -> None:
        """megatron-core's scratch kept between passes: the global memory buffer
        (`parallel_state.get_global_memory_buffer()`: core attention's and the tensor-parallel
        gathers' workspace, as large as the longest micro-step's) and RoPE's cache of position
        embeddings (`RotaryEmbedding.forward`'s lru_cache, up to 32 lengths). Both are
        allocated again, once each, at the next forward."""
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self._io = None
        parallel_state.get_global_memory_buffer().buffer.clear()
        RotaryEmbedding.forward.cache_clear()

    def _logprobs(self, step: MicroStep, *, grad: bool) -> tuple[torch.Tensor, Any]:
        st = step_tensors(step, self.device)
        n, width = st.ids.shape
        dtype, stage = self.flat_params.dtype, self.stage
        positions = torch.arange(width, device=self.device).expand(n, width)
        # Megatron's mask convention: True = masked out. Causal; right padding is never a
        # target's context, so no padding mask is needed.
        mask = torch.ones(width, width, dtype=torch.bool, device=self.device).triu(1)
        hidden = (width, n, int(self.model.config.hidden_size))  # type: ignore[union-attr,arg-type]
        received = stage.receive_forward(hidden, dtype, self.device)
        if received is not None:
            received.requires_grad_(grad)
            self.model.set_input_tensor(received)  # type: ignore[operator]
        with torch.set_grad_enabled(grad):
            out = self.model(st.ids, positions, mask[None, None])
            logp = self._target_logprobs(out, st.ids) if stage.last else None
        stage.send_forward(out)
        self._io = (received, out) if grad else None
        logp = stage.broadcast_from_last(logp, (n, width), main_dtype(dtype), self.device)
        check_finite(logp, st, f"micro-step {step.index}")
        return logp, st

    @staticmethod
    def _target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if _tp_size() == 1:
            return target_logprobs(logits, ids)
        return vocab_parallel_target_logprobs(logits, ids)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of this stage: from the loss on the last stage, from the next stage's
        gradient elsewhere; the input's gradient goes to the previous stage."""
        from gyre.train.megatron.pipeline import tied_gradients

        assert self._io is not None, "backward without a forward with grad"
        (received, out), self._io = self._io, None
        with tied_gradients(self.model, self.grad_of):
            if self.stage.last:
                loss.backward()
            else:
                torch.autograd.backward(out, self.stage.receive_backward(out))
            self.stage.send_backward(received.grad if received is not None else None)


def vocab_parallel_target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`target_logprobs` from this rank's vocabulary shard of the logits (Megatron's
    vocab-parallel cross-entropy over the tensor-parallel group).

    Megatron's kernel flattens its input with `.view` and works on it in place, so it gets a
    contiguous float32 copy: `logits[:, :-1]` is a strided slice, and in float32 `.float()`
    returns that same slice (a `.view` error, or with one row the model's logits
    overwritten). The result is float32 (for bf16 logits too, as `target_logprobs`'s)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    shard = logits[:, :-1]
    shard = (shard.clone() if shard.dtype == torch.float32 else shard.float()).contiguous()
    nll = vocab_parallel_cross_entropy(shard, ids[:, 1:])
    return torch.nn.functional.pad(-nll, (1, 0))


def _replicated_mask(model: torch.nn.Module, total: int, device: torch.device) -> torch.Tensor:
    """1 where a flat-buffer element counts toward the norm on this rank, else 0: a tensor
    replicated over the TP ranks counts on TP rank 0, a tied embedding on the first stage."""
    from megatron.core import parallel_state

    from gyre.train.megatron.pipeline import tied_copy

    first = parallel_state.get_tensor_model_parallel_rank() == 0
    duplicate = tied_copy(model) if not parallel_state.is_pipeline_first_stage() else None
    mask = torch.zeros(total, device=device)
    off = 0
    for p in (q for q in model.parameters() if q.requires_grad):
        n = p.numel()
        if p is not duplicate and (getattr(p, "tensor_model_parallel", False) or first):
            mask[off : off + n] = 1.0
        off += n
    return mask


class ModelParallelOptimizer(CoreOptimizer):
    """The core's AdamW per rank shard (`CoreOptimizer`'s step, mixed precision included);
    the clip norm is the whole model's norm."""

    def __init__(self, cell: TorchCell, config: OptimConfig) -> None:
        super().__init__(cell, config)
        self._mask = _replicated_mask(cell.model, cell.flat_params.numel(), cell.device)

    def global_norm(self, grads: torch.Tensor) -> float:
        """L2 norm over every TP / PP rank of the cell (replicated and tied tensors counted
        once)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        sq = (grads.float().square() * self._mask).sum()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        return float(sq.sqrt())
