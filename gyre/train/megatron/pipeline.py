"""Pipeline stages of a Megatron cell: a window of micro-steps run 1F1B through them.

With `train.parallel.pipeline` P > 1 a cell's ranks hold P consecutive blocks of layers (the
first stage the embedding, the last the final norm and output layer). A pass hands a cell a
window of micro-steps (`schedule.window`: the ones queued when it claims; phase A and phase
B apart): the first stage runs its layers on a micro-step and sends the hidden states
``[seq, rows, hidden]`` to the next stage (Megatron's `set_input_tensor`), the last stage
computes the target log-probs (and, in phase B, the loss), and the backward runs the other
way, each stage sending the gradient of its input to the previous. The stages keep each
other busy in Megatron's non-interleaved 1F1B order (`gyre.schedule.pipeline.one_f_one_b`,
the order the cost model times: P - 1 - stage warm-up
forwards, then a forward and a backward in turn, then the cool-down backwards), so a window
of m micro-steps idles a stage (P - 1) / (m + P - 1) of its time, not (P - 1) / P. Once the
window is through, the last stage's log-probs go to every stage (each stage then computes
the same ratio sums, objective coefficients and metrics). Sends pair the ranks of the same
tensor-parallel index (Megatron's pipeline groups); a send does not wait for its receiver
(`isend`, waited at the window's end), a receive does.

Why not megatron-core's own schedule (`forward_backward_pipelining_without_interleaving`):
Gyre's micro-steps differ in shape (rows x width), which Megatron carries only with
`variable_seq_lengths` (a shape exchange before every transfer), its loss comes back through
a data-iterator and loss-function protocol scaled by micro-batch and token counts, and it
allocates on CUDA where Gyre runs on CPU too (`total_num_tokens` on ``device="cuda"``, the
p2p receive buffers on `torch.cuda.current_device()`); the same order over plain
`torch.distributed` sends and receives needs none of that (docs/gpu.md).

    stage = Stage.current()              # after init_model_parallel
    order = one_f_one_b(stage.index, stage.size, m)    # gyre.schedule.pipeline
    timing = run_window(stage, order, forward, backward, sends)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre.schedule.pipeline import Pass


@dataclass(frozen=True, slots=True)
class Stage:
    """This rank's place in its pipeline (global torch.distributed ranks of its neighbours)."""

    index: int
    size: int
    prev: int | None  # the previous stage's rank (same tensor-parallel index), None if first
    next: int | None  # the next stage's rank, None if last
    last_rank: int  # the last stage's rank: it broadcasts the log-probs
    group: Any  # the pipeline group (this rank and its neighbours, every stage)
    waits: list[float] = field(default_factory=list)  # seconds blocked in each receive

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
        return self._receive(self.prev, shape, dtype, device)

    def send_forward(self, hidden: torch.Tensor, sends: Sends | None = None) -> None:
        """This stage's output hidden states to the next stage (nothing on the last); into
        `sends` without waiting where given."""
        if self.next is not None:
            _send(hidden.detach().contiguous(), self.next, sends)

    def receive_backward(self, output: torch.Tensor) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        assert self.next is not None, "the last stage's output is the loss"
        return self._receive(self.next, tuple(output.shape), output.dtype, output.device)

    def send_backward(self, input_grad: torch.Tensor | None, sends: Sends | None = None) -> None:
        """The gradient of this stage's input to the previous stage (nothing on the first)."""
        if self.prev is not None:
            assert input_grad is not None, "a non-first stage's input got no gradient"
            _send(input_grad.contiguous(), self.prev, sends)

    def _receive(self, src: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
        buf = torch.empty(shape, dtype=dtype, device=device)
        t0 = time.perf_counter()
        torch.distributed.recv(buf, src=src)
        self.waits.append(time.perf_counter() - t0)
        return buf

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


Sends = list[tuple[Any, torch.Tensor]]  # sends in flight: (work, the tensor it sends)


def _send(tensor: torch.Tensor, dst: int, sends: Sends | None) -> None:
    if sends is None:
        torch.distributed.send(tensor, dst=dst)
    else:
        sends.append((torch.distributed.isend(tensor, dst=dst), tensor))


@dataclass(frozen=True, slots=True)
class WindowTiming:
    """One stage's clock over a window: its wall time and the part it computed (the rest
    it waited on a neighbour: the pipeline's bubble, and transfers)."""

    wall_s: float
    busy_s: float

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def run_window(
    stage: Stage, order: list[Pass], forward: Callable[[int], None],
    backward: Callable[[int], None], sends: Sends,
) -> WindowTiming:  # fmt: skip
    """Run a stage's passes in `order` (`forward(i)` / `backward(i)` receive through `stage`
    and send into `sends`), then wait for the sends; timed from the first pass to the last
    send, the receives and that last wait counted as idle."""
    stage.waits.clear()
    t0 = time.perf_counter()
    for kind, i in order:
        (forward if kind == "F" else backward)(i)
    t1 = time.perf_counter()
    for work, _ in sends:
        work.wait()
    sends.clear()
    wall = time.perf_counter() - t0
    stage.waits.append(time.perf_counter() - t1)
    return WindowTiming(wall_s=wall, busy_s=wall - sum(stage.waits))


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
