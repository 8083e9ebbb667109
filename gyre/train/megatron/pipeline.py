"""Pipeline stages of a Megatron cell: one micro-step forward stage by stage, backward back.

With `train.parallel.pipeline` P > 1 a cell's ranks hold P consecutive blocks of layers (the
first stage the embedding, the last the final norm and output layer). Gyre's cell protocol
hands a cell one micro-step at a time (phase A, then phase B, each claimed by whichever cell
is free), so a micro-step is a pipeline's only micro-batch: the first stage runs its layers
and sends the hidden states ``[seq, rows, hidden]`` to the next stage (Megatron's
`set_input_tensor`), the last stage computes the target log-probs and broadcasts them to
every stage (each stage then computes the same objective coefficients and metrics), and the
backward runs the other way, each stage sending the gradient of its input to the previous.
Sends pair the ranks of the same tensor-parallel index (Megatron's pipeline groups).

Megatron-core's own schedule (`get_forward_backward_func`) with one micro-batch per call is
this same sequence, but it takes its loss through a data-iterator and loss-function
protocol and allocates on CUDA where Gyre runs on CPU too (`total_num_tokens` on
``device="cuda"``, its p2p receive buffers on `torch.cuda.current_device()`); so the stages
talk through plain `torch.distributed` sends and receives here (docs/gpu.md).

    stage = Stage.current()              # after init_model_parallel
    hidden = stage.receive_forward(shape, dtype, device)   # None on the first stage
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Stage:
    """This rank's place in its pipeline (global torch.distributed ranks of its neighbours)."""

    index: int
    size: int
    prev: int | None  # the previous stage's rank (same tensor-parallel index), None if first
    next: int | None  # the next stage's rank, None if last
    last_rank: int  # the last stage's rank: it broadcasts the log-probs
    group: Any  # the pipeline group (this rank and its neighbours, every stage)

    @classmethod
    def current(cls) -> Stage:
        """This rank's stage, from Megatron's parallel_state."""
        from megatron.core import parallel_state as ps

        index = ps.get_pipeline_model_parallel_rank()
        size = ps.get_pipeline_model_parallel_world_size()
        return cls(
            index=index, size=size,
            prev=ps.get_pipeline_model_parallel_prev_rank() if index > 0 else None,
            next=ps.get_pipeline_model_parallel_next_rank() if index < size - 1 else None,
            last_rank=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )  # fmt: skip

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def receive_forward(self, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor | None:  # fmt: skip
        """The previous stage's output hidden states (None on the first stage)."""
        if self.prev is None:
            return None
        return _receive(self.prev, shape, dtype, device)

    def send_forward(self, hidden: torch.Tensor) -> None:
        """This stage's output hidden states to the next stage (nothing on the last)."""
        if self.next is not None:
            torch.distributed.send(hidden.detach().contiguous(), dst=self.next)

    def receive_backward(self, output: torch.Tensor) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        assert self.next is not None, "the last stage's output is the loss"
        return _receive(self.next, tuple(output.shape), output.dtype, output.device)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        """The gradient of this stage's input to the previous stage (nothing on the first)."""
        if self.prev is not None:
            assert input_grad is not None, "a non-first stage's input got no gradient"
            torch.distributed.send(input_grad.contiguous(), dst=self.prev)

    def broadcast_from_last(self, logp: torch.Tensor | None, shape: tuple[int, ...],
                            dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # fmt: skip
        """The last stage's log-probs on every stage (the last keeps its own, graph and all)."""
        if self.size == 1:
            assert logp is not None
            return logp
        buf = logp.detach() if self.last and logp is not None else torch.empty(
            shape, dtype=dtype, device=device)  # fmt: skip
        torch.distributed.broadcast(buf, src=self.last_rank, group=self.group)
        return logp if self.last and logp is not None else buf


def _receive(src: int, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:  # fmt: skip
    buf = torch.empty(shape, dtype=dtype, device=device)
    torch.distributed.recv(buf, src=src)
    return buf


def tied_copy(model: Any) -> torch.nn.Parameter | None:
    """This stage's copy of an embedding tied to the output layer, when the two sit on
    different stages (the first stage's embedding, the last stage's output layer), else None."""
    if not model.share_embeddings_and_output_weights or model.pre_process == model.post_process:
        return None
    weight: torch.nn.Parameter = model.shared_embedding_or_output_weight()
    return weight


@contextlib.contextmanager
def tied_gradients(
    model: Any, grad_of: Callable[[torch.nn.Parameter], torch.Tensor]
) -> Iterator[None]:
    """Keep the two copies of a tied embedding's gradient equal across a backward: what the
    block adds to either copy is summed over the embedding group (first and last stage) and
    added to both, as Megatron's `finalize_model_grads` does (to its float32 `main_grad`);
    elsewhere a no-op. `grad_of(weight)`: the gradient the cell accumulates for the weight
    (`TorchCell.grad_of`: float32 for a mixed-precision cell)."""
    weight = tied_copy(model)
    if weight is None:
        yield
        return
    from megatron.core import parallel_state

    grad = grad_of(weight)
    before = grad.detach().clone()
    yield
    added = grad.detach() - before
    torch.distributed.all_reduce(added, group=parallel_state.get_embedding_group())
    grad.copy_(before + added)
