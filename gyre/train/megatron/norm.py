"""The RMSNorm of Gyre's Megatron layer spec: torch's, allowed under sequence parallelism.

Without Transformer Engine or Apex, megatron-core 0.16's local spec norms are
`WrappedTorchNorm`, which refuses `sequence_parallel` (its weights would not be marked for
the tensor-parallel gradient sum, `finalize_model_grads`). Under sequence parallelism each
TP rank normalizes its own slice of the sequence with a weight replicated on every TP rank,
so its gradient is this slice's part only; Megatron's fused norms mark such a weight
`sequence_parallel = True` and `finalize_model_grads` sums the marked weights' gradients
over the tensor-parallel group. `RMSNorm` builds the same `torch.nn.RMSNorm` as
`WrappedTorchNorm` and marks its weight the same way, and Gyre's cell sums the marked
gradients (`gyre.train.megatron.model.tp_summed_gradients`), on CUDA and CPU alike:

    spec.submodules.input_layernorm = RMSNorm   # in gyre.train.megatron.attention.layer_spec
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm:
    """`torch.nn.RMSNorm(hidden_size, eps)` in a Megatron norm slot (layers, q/k, final),
    its weight marked `sequence_parallel` as the config says."""

    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> torch.nn.RMSNorm:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"RMSNorm: normalization {config.normalization!r}, zero-centered gamma "
                f"{config.layernorm_zero_centered_gamma}; allowed RMSNorm, False"
            )
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm
