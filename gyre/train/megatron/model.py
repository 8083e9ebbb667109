"""Megatron-core policy model and the training cell that runs it.

`build_rank_model(hf_config, weights, cfg, device=...)` is what every Megatron rank runs: it
prepares Megatron's process state for the rank's device (`init_model_parallel`), builds a
`GPTModel` there (`build_gpt_model`: Megatron's local layer spec, plain torch modules, no
Transformer Engine needed, with `SDPAttention` as core attention, `gyre.train.megatron.attention`)
from a Hugging Face config dict (a family of `gyre.train.megatron.config`), without
initializing its weights, and loads the rank's Megatron tensors into it. `MegatronCell` is a
`gyre.train.cell.TorchCell` over that model: the same flat parameter / gradient buffers,
phase-A prepass and phase-B accumulate of the same micro-steps and objective, so the world
protocol (`gyre.runtime.coordinator.training`, docs/training.md) and transports work
unchanged. With tensor parallelism the logits are
vocabulary-sharded and the chunked target log-probs all-reduce each chunk's statistics over
the tensor-parallel group (`target_logprobs(..., vocab_shard=...)`); with pipeline
parallelism a pass's window of micro-steps runs 1F1B through the stages
(`gyre.train.megatron.pipeline`) and every stage gets the last stage's log-probs.
`ModelParallelOptimizer` is the core's optimizer: AdamW on each rank's shard, with the
global gradient norm summed over the cell's model-parallel group
(replicated parameters and the last stage's copy of a tied embedding counted once), so
clipping matches a single-device run.

On a CUDA device Megatron needs its model-parallel RNG seeded before the first forward (its
core attention forks the "model-parallel-rng" CUDA state, dropout or not); on the CPU
(`train.device: cpu`, with or without a GPU on the machine) `init_model_parallel` applies
instead the six scoped patches of `gyre.train.megatron.cpu` (megatron-core calls
`torch.cuda` at six points even with every fusion off).

    # after torch.distributed.init_process_group
    model = build_rank_model(hf_config, stage_to_mcore(...), MegatronConfig(), device="cuda:0")
    cell = MegatronCell(model, objective=ObjectiveConfig())
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gyre.errors import TrainingError
from gyre.train.cell import CoreOptimizer, StepStats, TorchCell, main_dtype
from gyre.train.config import ObjectiveConfig, OptimConfig
from gyre.train.megatron.config import MegatronConfig, gpt_kwargs, transformer_kwargs
from gyre.train.objective import (
    ExecutionScalar,
    VocabShard,
    check_finite,
    ratio_sums,
    step_loss,
    step_tensors,
    target_logprobs,
    token_coefficients,
)
from gyre.train.packing import MicroStep

if TYPE_CHECKING:
    from gyre.train.megatron.pipeline import WindowTiming


def init_model_parallel(cfg: MegatronConfig, device: str | torch.device) -> None:
    """Megatron's process state for a model on `device`, over the current torch.distributed
    world (TP × PP × DP inside a cell, experts folded onto the TP ranks): `parallel_state`, then
    on a CUDA device that device bound and Megatron's model-parallel RNG seeded
    (`model_parallel_cuda_manual_seed`), on the CPU the scoped patches of
    `gyre.train.megatron.cpu`.

    Cell ranks must be contiguous in the torch.distributed numbering (`GroupLayout.dist_rank`):
    Megatron's data-parallel group then holds every cell's replicas at one shard position
    (Gyre never reduces over it: it sums a cell's replicas over `comms.replicas`, then the
    cells over the prefix communicators, `gyre.runtime.cell.trainer`).
    """
    import_megatron()
    from megatron.core import parallel_state, tensor_parallel

    from gyre.train.megatron import cpu

    if not parallel_state.model_parallel_is_initialized():
        # "pp" before "dp": a replica's TP x PP ranks are contiguous, shard s = TP rank s % TP
        # of stage s // TP % PP in the cell's replica s // (TP x PP), world size / (TP x PP)
        # replicas in all (Megatron's default order puts the pipeline outermost, across cells).
        # Experts fold onto the TP ranks (EP x ETP = TP): TP rank t holds the experts of EP
        # rank t // ETP, split as ETP rank t % ETP; expert data parallelism runs across cells.
        parallel_state.initialize_model_parallel(
            cfg.tensor_parallel, cfg.pipeline_parallel, order="tp-cp-ep-pp-dp",
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel,
        )  # fmt: skip
    if _on_cuda(device):
        _bind(device)
        # after parallel_state (the seeds depend on the TP rank); Megatron's attention forks
        # the tracker's "model-parallel-rng" state at every forward
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    else:
        cpu.enable()  # Megatron's six CUDA-only points (gyre.train.megatron.cpu)


def _on_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _bind(device: str | torch.device) -> torch.device:
    """Where Megatron puts this rank's model: on CUDA the current device, made `device` when
    it names one (Megatron allocates at `torch.cuda.current_device()`); else `device`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is not None:
        torch.cuda.set_device(dev)
    return torch.device(torch.cuda.current_device())


def import_megatron() -> None:
    """Import megatron-core as Gyre's processes do: without what it imports that Gyre never
    uses. Every Megatron rank calls it before its first `megatron` import (`gyre run`'s rank
    zygote too, `gyre.runtime.main.preload`); where megatron-core is already imported it
    changes nothing.

    - Without wandb: megatron-core imports it at module level where it is installed (its
      timers and inference contexts could log to it), ~0.35 CPU-s, and wandb is installed for
      the coordinator's tracker. A `None` entry in `sys.modules` makes that import fail as if
      wandb were absent, which megatron-core handles; the entry is removed afterwards, so
      wandb stays importable in this process.
    - On a torch built without CUDA, without its `torch.compile` fusions: megatron-core's
      `jit_fuser` is `torch.compile`, bound as its modules are imported, and decorating its
      ~20 fused functions imports `torch._dynamo` and `torch._inductor` (~1 CPU-s) for kernels
      made for GPUs. Here `torch.compile` is a no-op while megatron-core imports, so its fused
      functions run eagerly, as its own `megatron.core.jit.disable_jit_fuser()` makes them
      (which it cannot do before they are decorated); Gyre's configs call none of them
      (`bias_activation_fusion` off, no expert bias, no output gate). A CUDA build keeps
      megatron-core's default.
    """
    if "megatron.core" in sys.modules:
        return
    blocked = "wandb" not in sys.modules
    if blocked:
        sys.modules["wandb"] = None  # type: ignore[assignment]
    compile_, eager = torch.compile, not torch.backends.cuda.is_built()
    if eager:
        torch.compile = _eager  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        if eager:
            jit.disable_jit_fuser()  # for its modules imported later
    finally:
        torch.compile = compile_  # type: ignore[assignment]
        if blocked and sys.modules.get("wandb", "") is None:
            del sys.modules["wandb"]


def _eager(model: Any = None, **_options: Any) -> Any:
    """`torch.compile`'s stand-in while megatron-core imports on a CPU-only torch: the
    function itself, as a call or as a decorator factory."""
    return model if model is not None else (lambda fn: fn)


def build_gpt_model(
    hf_config: Mapping[str, Any], cfg: MegatronConfig, *, device: str | torch.device
) -> torch.nn.Module:
    """This rank's GPTModel (its TP shard of its pipeline stage) on `device`, its weights
    allocated but not initialized (`perform_initialization=False`): the caller loads them
    next (`build_rank_model`). `init_model_parallel(cfg, device)` first."""
    import_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gyre.train.megatron.attention import block_spec, layer_spec

    dtype = getattr(torch, cfg.dtype)
    place = _bind(device)
    _router_without_transformer_engine()
    tc = TransformerConfig(
        **transformer_kwargs(hf_config, cfg),
        activation_func=torch.nn.functional.silu,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # of the hidden states sent between stages
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not _on_cuda(device),  # else on torch.cuda.current_device()
        perform_initialization=False,  # weights are loaded right after: no random init
    )
    layer = layer_spec(cfg.attention, qk_layernorm=tc.qk_layernorm, num_experts=tc.num_moe_experts)
    model = GPTModel(
        tc,
        block_spec(layer, tc),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **gpt_kwargs(hf_config),
    )
    _mark_tensor_parallel(model)
    # what Megatron leaves to torch's default device (its local norms) follows the weights
    return model.to(device=place, dtype=dtype)


def _router_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MoE router GEMM (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, but `moe_utils` defines that name only when Transformer
    Engine imports: without TE (Gyre's local spec, on CPU and CUDA alike) every MoE forward
    dies with a NameError. Defining it as None where the import failed gives the function's
    own torch branch (`torch.mm` in the router dtype); with TE this changes nothing."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """The tensor-parallel attributes of the sharded weights, which Megatron's local layers
    set only while initializing them (`_initialize_affine_weight_cpu/gpu`, skipped with
    `perform_initialization=False`): `tensor_model_parallel`, `partition_dim` (0 for
    column-parallel layers and the vocab-parallel embedding, 1 for row-parallel layers) and
    `partition_stride` (2 for a gated MLP's `linear_fc1`: megatron/core/transformer/mlp.py).
    Without them a sharded weight reads as replicated over the TP ranks (Gyre's clip norm,
    Megatron's `param_is_not_tensor_parallel_duplicate`). Checked against a build that
    initializes, in tests/gpu/test_gpu_megatron_weights.py."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.mlp import MLP

    strides = {id(m.linear_fc1): 2 for m in model.modules()
               if isinstance(m, MLP) and m.config.gated_linear_unit}  # fmt: skip
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        set_tensor_model_parallel_attributes(weight, True, dim, strides.get(id(module), 1))


def build_rank_model(
    hf_config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    cfg: MegatronConfig,
    *, device: str | torch.device,
) -> torch.nn.Module:  # fmt: skip
    """This rank's model on `device` holding `weights` (its Megatron tensors, e.g. from
    `stage_to_mcore`, or a stream of (name, tensor) read one at a time from the model's
    files), in training mode: Megatron's process state for the device
    (`init_model_parallel`), the model built uninitialized there, every tensor loaded as it
    comes (so a streaming rank holds its model and one tensor)."""
    from gyre.rollout.weights import load_named_tensors
    from gyre.train.megatron.weights import tensor_state

    init_model_parallel(cfg, device)
    model = build_gpt_model(hf_config, cfg, device=device)
    loaded = set()
    for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
        load_named_tensors(model, [(name, tensor)])
        loaded.add(name)
    missing = sorted(set(tensor_state(model)) - loaded)
    if missing:
        raise TrainingError(f"megatron rank: no weights given for {missing[:5]} "
                            f"({len(missing)} tensors would stay uninitialized)")  # fmt: skip
    return model.train()


def _tp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_world_size())


class MegatronCell(TorchCell):
    """A cell rank running its tensor-parallel shard of one pipeline stage of a GPTModel.

    Every rank runs every row. With pipeline stages (`gyre.train.megatron.pipeline`) a
    pass's window of micro-steps runs 1F1B through the stages and every stage gets the last
    stage's log-probs; one micro-step alone runs forward stage by stage (`_logprobs`) and
    `_backward` sends the input gradients back stage by stage."""

    def __init__(self, model: torch.nn.Module, *, objective: ObjectiveConfig) -> None:
        from gyre.train.megatron.pipeline import Stage
        from gyre.train.megatron.replay import attach

        super().__init__(model, objective=objective)
        self.stage = Stage.current()
        self._replays = attach(model)  # routing replay of a MoE model's routers
        # Megatron's DotProductAttention needs the causal mask as a tensor (its own default
        # one is made on "cuda"); SDPAttention is causal without one (no len x len tensor)
        self._explicit_mask = any(_materialises_scores(m) for m in model.modules())
        # this stage's (received input, output) of the latest forward with grad: the backward's
        self._io: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self.timing: WindowTiming | None = None  # this stage's clock over the latest window

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
        """One micro-step alone through the stages (a tool's or test's single pass; a cell's
        passes run windows: `prepass_window`, `accumulate_window`)."""
        st = step_tensors(step, self.device)
        received, out, logp, padded = self._stage_forward(step, st, grad=grad)
        self.stage.send_forward(out)
        self._io = (received, out) if grad else None
        return self._final_logprobs(step, st, logp, padded), st

    def _stage_forward(
        self, step: MicroStep, st: Any, *, grad: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, int]:
        """This stage's forward of a micro-step: (the input received from the previous stage,
        this stage's output, the target log-probs on the last stage else None, the padded
        width)."""
        n, _ = st.ids.shape
        stage, config = self.stage, self._config
        # Under sequence parallelism the rows are cut into TP slices along the sequence: the
        # width is padded to a multiple of TP, on the right, where (causal attention) no
        # real position sees it; its log-probs are dropped, so it adds no gradient.
        ids = pad_to_multiple(st.ids, _tp_size() if config.sequence_parallel else 1)
        padded = ids.shape[1]
        positions = torch.arange(padded, device=self.device).expand(n, padded)
        # Causal; right padding is never a target's context, so no padding mask is needed.
        # Megatron's mask convention: True = masked out.
        mask = None
        if self._explicit_mask:
            mask = torch.ones(padded, padded, dtype=torch.bool, device=self.device).triu(1)
        dtype = self.flat_params.dtype
        received = stage.receive_forward(self._hidden_shape(n, padded), dtype, self.device)
        if received is not None:
            received.requires_grad_(grad)
            self.model.set_input_tensor(received)  # type: ignore[operator]
        with torch.set_grad_enabled(grad), self._routing(step, padded):
            out = self.model(ids, positions, None if mask is None else mask[None, None])
            logp = self._target_logprobs(out, ids) if stage.last else None
        return received, out, logp, padded

    def _final_logprobs(
        self, step: MicroStep, st: Any, logp: torch.Tensor | None, padded: int
    ) -> torch.Tensor:
        """The last stage's log-probs of a micro-step on every stage (the last keeps its
        own, graph and all), cut to the rows' width and checked."""
        n, width = st.ids.shape
        dtype = main_dtype(self.flat_params.dtype)
        logp = self.stage.broadcast_from_last(logp, (n, padded), dtype, self.device)[:, :width]
        check_finite(logp, st, f"micro-step {step.index}")
        return logp

    def prepass_window(self, steps: Sequence[MicroStep]) -> list[dict[str, float]]:
        """Phase A of a window: its forwards through the stages back to back."""
        if self.stage.size == 1:
            return super().prepass_window(steps)
        return [ratio_sums(logp, st) for logp, st in self._pipelined(steps, None)]

    def accumulate_window(
        self, steps: Sequence[MicroStep], scalars: Mapping[str, ExecutionScalar]
    ) -> list[StepStats]:
        """Phase B of a window, 1F1B through the stages; every stage's stats from the last
        stage's log-probs."""
        if self.stage.size == 1:
            return super().accumulate_window(steps, scalars)
        stats = []
        for logp, st in self._pipelined(steps, scalars):
            coeff = token_coefficients(logp.detach(), st, scalars, self.objective)
            stats.append(StepStats(targets=int(st.targets.sum()), objective=float(coeff.sum())))
        return stats

    def _pipelined(
        self, steps: Sequence[MicroStep], scalars: Mapping[str, ExecutionScalar] | None
    ) -> list[tuple[torch.Tensor, Any]]:
        """A window through the pipeline stages (`gyre.train.megatron.pipeline`): forwards
        only (`scalars` None), or forward and backward 1F1B, the last stage's loss the
        objective of each micro-step with `scalars`. Returns each micro-step's log-probs
        (detached) and tensors, on every stage; `self.timing` is this stage's clock."""
        from gyre.schedule.pipeline import one_f_one_b
        from gyre.train.megatron.pipeline import Sends, run_window, tied_gradients

        stage, grad = self.stage, scalars is not None
        sts = [step_tensors(step, self.device) for step in steps]
        live: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = {}
        last: dict[int, tuple[torch.Tensor, int]] = {}  # the last stage's log-probs, width
        sends: Sends = []

        def forward(i: int) -> None:
            received, out, logp, padded = self._stage_forward(steps[i], sts[i], grad=grad)
            stage.send_forward(out, sends)
            loss = None
            if logp is not None:
                last[i] = (logp.detach(), padded)
                if scalars is not None:
                    mine = logp[:, : sts[i].ids.shape[1]]
                    coeff = token_coefficients(mine, sts[i], scalars, self.objective)
                    loss = step_loss(mine, coeff)
            if grad:
                live[i] = (received, out, loss)

        def backward(i: int) -> None:
            received, out, loss = live.pop(i)
            if loss is not None:
                loss.backward()
            else:
                torch.autograd.backward(out, stage.receive_backward(out))
            stage.send_backward(received.grad if received is not None else None, sends)

        order = one_f_one_b(stage.index, stage.size, len(steps), backward=grad)
        with contextlib.ExitStack() as summed:
            if grad:
                summed.enter_context(tied_gradients(self.model, self.grad_of))
                summed.enter_context(tp_summed_gradients(self.model, self.grad_of))
            self.timing = run_window(stage, order, forward, backward, sends)
        width = [self._padded(st) for st in sts]
        return [(self._final_logprobs(step, st, last.get(i, (None, 0))[0], width[i]), st)
                for i, (step, st) in enumerate(zip(steps, sts, strict=True))]  # fmt: skip

    def _padded(self, st: Any) -> int:
        """A micro-step's width as the stages run it (a multiple of TP under sequence
        parallelism)."""
        multiple = _tp_size() if self._config.sequence_parallel else 1
        return int(st.ids.shape[1] + -st.ids.shape[1] % multiple)

    def _routing(self, step: MicroStep, width: int) -> contextlib.AbstractContextManager[None]:
        """The step's recorded routed experts replayed by this rank's routers
        (`gyre.train.megatron.replay`), each TP rank's slice under sequence parallelism."""
        from megatron.core import parallel_state

        from gyre.train.megatron.replay import replayed
        from gyre.train.packing import step_routing

        routing = step_routing(step, width) if self._replays else None
        split = bool(self._config.sequence_parallel)
        return replayed(
            self._replays, routing, tp_size=_tp_size() if split else 1,
            tp_rank=parallel_state.get_tensor_model_parallel_rank() if split else 0,
        )  # fmt: skip

    @property
    def _config(self) -> Any:
        """The model's `TransformerConfig`."""
        return self.model.config

    def _hidden_shape(self, rows: int, width: int) -> tuple[int, int, int]:
        """The hidden states a stage sends the next: `[seq, rows, hidden]`, this TP rank's
        slice of the sequence under sequence parallelism."""
        config = self._config
        seq = width // _tp_size() if config.sequence_parallel else width
        return seq, rows, int(config.hidden_size)

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
        with tied_gradients(self.model, self.grad_of), tp_summed_gradients(self.model,
                                                                           self.grad_of):  # fmt: skip
            if self.stage.last:
                loss.backward()
            else:
                torch.autograd.backward(out, self.stage.receive_backward(out))
            self.stage.send_backward(received.grad if received is not None else None)


def pad_to_multiple(ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """`ids` [rows, width] right-padded with token 0 to a width divisible by `multiple`."""
    extra = -ids.shape[1] % multiple
    return torch.nn.functional.pad(ids, (0, extra)) if extra else ids


def tp_partial(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Replicated weights whose gradient each TP rank computes from part of the micro-step
    only, as Megatron's `finalize_model_grads` picks them to sum over the tensor-parallel
    group: the per-head q / k norms (Qwen3's `qk_layernorm`: this rank's heads), and under
    sequence parallelism every weight marked `sequence_parallel` (this rank's slice of the
    sequence: the norms, `gyre.train.megatron.norm`; a MoE router; a shared expert's gate)."""
    sequence = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
    return [p for n, p in model.named_parameters()
            if p.requires_grad and ("q_layernorm" in n or "k_layernorm" in n
                                    or (sequence and getattr(p, "sequence_parallel", False)))]  # fmt: skip


@contextlib.contextmanager
def tp_summed_gradients(
    model: torch.nn.Module, grad_of: Callable[[torch.nn.Parameter], torch.Tensor]
) -> Iterator[None]:
    """What the block adds to a `tp_partial` weight's gradient, summed over the
    tensor-parallel group (so every TP rank holds the whole model's gradient of the
    replicated weight, in one all-reduce per backward); a no-op at TP 1 or without such
    weights."""
    params = tp_partial(model) if _tp_size() > 1 else []
    before = [grad_of(p).detach().clone() for p in params]
    yield
    if not params:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state

    added = torch.cat([(grad_of(p) - b).reshape(-1) for p, b in zip(params, before, strict=True)])
    dist.all_reduce(added, group=parallel_state.get_tensor_model_parallel_group())
    off = 0
    for p, b in zip(params, before, strict=True):
        grad_of(p).copy_(b + added[off : off + p.numel()].view_as(p))
        off += p.numel()


def vocab_parallel_target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`target_logprobs` from this rank's vocabulary shard of the logits (the output layer's
    vocab-parallel split over the tensor-parallel group): chunked over the sequence like
    TP 1's, each chunk's max, sum and target logit all-reduced over the group, so no float32
    copy of the logits nor a saved softmax (Megatron's `vocab_parallel_cross_entropy` keeps
    both)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}

    def reduce(t: torch.Tensor, op: str) -> None:
        dist.all_reduce(t, op=ops[op], group=group)

    size = logits.shape[-1]
    shard = VocabShard(start=parallel_state.get_tensor_model_parallel_rank() * size, size=size,
                       reduce=reduce)  # fmt: skip
    return target_logprobs(logits, ids, vocab_shard=shard)


def _materialises_scores(module: torch.nn.Module) -> bool:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return isinstance(module, DotProductAttention)


def _replicated_mask(model: torch.nn.Module, total: int, device: torch.device) -> torch.Tensor:
    """1 where a flat-buffer element counts toward the norm on this rank, else 0: a tensor
    replicated over the TP ranks counts on TP rank 0, a tied embedding on the first stage; a
    tensor-parallel shard, and a routed expert under expert parallelism (Megatron marks it
    `allreduce = False`: its own experts on each EP rank of a replica), count on every rank.
    Only a cell's first data-parallel replica steps, so each element counts once."""
    from megatron.core import parallel_state

    from gyre.train.megatron.pipeline import tied_copy

    first = parallel_state.get_tensor_model_parallel_rank() == 0
    duplicate = tied_copy(model) if not parallel_state.is_pipeline_first_stage() else None
    mask = torch.zeros(total, device=device)
    off = 0
    for p in (q for q in model.parameters() if q.requires_grad):
        n = p.numel()
        sharded = getattr(p, "tensor_model_parallel", False) or not getattr(p, "allreduce", True)
        if p is not duplicate and (sharded or first):
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
        """L2 norm over every TP / PP rank of the cell's first replica, Megatron's
        model-parallel group (replicated and tied tensors counted once)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        sq = (grads.float().square() * self._mask).sum()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        return float(sq.sqrt())
