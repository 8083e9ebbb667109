"""Megatron-core on a CPU: the six scoped patches that let its forward and backward run.

megatron-core (0.16) assumes a CUDA device at six points even with every fusion off:

* `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` at the first
  forward — here it runs with the tensor's own device instead;
* `parallel_state`'s `GlobalMemoryBuffer` (scratch space of Megatron's `DotProductAttention`
  and the tensor-parallel collectives) allocates on the CUDA device — here a subclass
  allocates in host memory;
* the model-parallel RNG tracker refuses any forward whose "model-parallel-rng" CUDA state
  was never added (even with dropout 0; on CUDA `model_parallel_cuda_manual_seed` adds it)
  — here Megatron's own `initialize_rng_tracker(inference_rng_tracker=True,
  force_reset=True)` installs its no-state tracker;
* with pipeline stages and tied embeddings, `LanguageModule.setup_embeddings_and_output_layer`
  (run by the model's constructor) moves the stage's copy of the tied embedding with
  `.cuda()` before all-reducing it over the embedding group — here, for that call only,
  `Tensor.cuda` leaves a tensor where it is;
* a mixture-of-experts router (`Router.gating`) moves a weight it finds on the CPU to
  `torch.cuda.current_device()` at every forward — here it runs with its weight's own
  device instead (on CUDA the weight is already there, and Megatron's code runs as is);
* sequence parallelism's collectives (`tensor_parallel.mappings`' gathers and
  reduce-scatters along the sequence and `LinearWithGradAccumulationAndAsyncCommunication`'s
  backward, which reduce-scatters the input gradient) allocate their outputs on
  `torch.cuda.current_device()` — here they run with their input's own device.

`enable()` applies them; `gyre.train.megatron.model.init_model_parallel` calls it for a
model on the CPU only (`train.device: cpu`, whether or not the machine has a GPU), after
every `parallel_state` initialization (which makes a new buffer and tracker). A model on a
CUDA device runs unpatched Megatron, seeded as Megatron requires
(tests/gpu/test_gpu_megatron_cpu.py runs that path on CPU with device stand-ins and checks
that each patch is off).

    init_model_parallel(cfg, "cpu")     # calls cpu.enable()
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch

_rotary_patched = False


def active() -> bool:
    """Whether the patches are in force in this process."""
    return _rotary_patched


def enable() -> None:
    """Apply the patches (after `parallel_state` is initialized), for a model on the CPU."""
    global _rotary_patched
    if not _rotary_patched:
        _patch_rotary()
        _patch_tied_embedding_setup()
        _patch_router()
        _patch_sequence_parallel()
        _rotary_patched = True
    _host_memory_buffer()
    _rng_tracker()


@contextlib.contextmanager
def _current_device(device: torch.device) -> Iterator[None]:
    """`torch.cuda.current_device()` answers `device` for the duration of the block."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: device  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[method-assign]


def _patch_rotary() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    original: Callable[..., torch.Tensor] = RotaryEmbedding.get_emb

    @functools.wraps(original)
    def get_emb(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with _current_device(self.inv_freq.device):
            return original(self, *args, **kwargs)

    RotaryEmbedding.get_emb = get_emb  # type: ignore[method-assign]


@contextlib.contextmanager
def _tensors_stay() -> Iterator[None]:
    """`Tensor.cuda()` returns the tensor itself for the duration of the block."""
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved  # type: ignore[method-assign]


def _patch_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original: Callable[..., None] = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _tensors_stay():
            original(self)

    LanguageModule.setup_embeddings_and_output_layer = (  # type: ignore[method-assign]
        setup_embeddings_and_output_layer
    )


def _patch_router() -> None:
    from megatron.core.transformer.moe.router import Router

    original: Callable[..., torch.Tensor] = Router.gating

    @functools.wraps(original)
    def gating(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with _current_device(self.weight.device):
            return original(self, *args, **kwargs)

    Router.gating = gating  # type: ignore[method-assign]


SEQUENCE_COLLECTIVES = (
    "_gather_along_first_dim", "_gather_along_last_dim", "_reduce_scatter_along_first_dim",
)  # fmt: skip
"""`megatron.core.tensor_parallel.mappings`' functions patched (the autograd functions of the
sequence-parallel regions call them by these module-level names)."""


def _on_input_device(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def run(input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with _current_device(input_.device):
            return original(input_, *args, **kwargs)

    return run


def _patch_sequence_parallel() -> None:
    from megatron.core.tensor_parallel import layers, mappings

    for name in SEQUENCE_COLLECTIVES:
        setattr(mappings, name, _on_input_device(getattr(mappings, name)))
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    original: Callable[..., Any] = linear.backward

    @functools.wraps(original)
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        with _current_device(grad_output.device):
            return original(ctx, grad_output)

    backward.gyre_cpu_patch = True  # type: ignore[attr-defined]  # Megatron's has __wrapped__
    linear.backward = staticmethod(backward)  # type: ignore[method-assign,assignment]


def _host_memory_buffer() -> None:
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    class HostMemoryBuffer(GlobalMemoryBuffer):  # type: ignore[misc]
        """Megatron's scratch buffer, in host memory."""

        def get_tensor(self, tensor_shape: Any, dtype: torch.dtype, name: str,
                       mem_alloc_context: Any = None) -> torch.Tensor:  # fmt: skip
            need = functools.reduce(operator.mul, tensor_shape, 1)
            held = self.buffer.get((name, dtype))
            if held is None or held.numel() < need:
                self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype, device="cpu")
            return self.buffer[(name, dtype)][0:need].view(*tensor_shape)

    parallel_state._GLOBAL_MEMORY_BUFFER = HostMemoryBuffer()


def _rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
