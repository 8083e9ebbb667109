"""Typed configuration of the training plane (no torch import: safe for CLI modules).

`TrainConfig` is the run YAML's `train:` section, flat, strict like every Gyre config
(`gyre.config.load(TrainConfig, data, path="train")` names a bad key and what is allowed):

    train:
      lr: 1.0e-6                 # the core's AdamW (beta1, beta2, eps, weight_decay, grad_clip)
      lr_schedule: cosine        # or constant (the default), linear_warmup
      warmup_steps: 10           # linear warmup to lr over the first updates
      min_lr: 1.0e-7             # cosine's floor, reached at decay_steps (null: the run's steps)
      clip_low: 0.995            # execution-level sequence clipping
      clip_high: 1.005
      token_weight_cap: 5.0      # the IS cap on token weights
      j_max: 5                   # trajectories admitted per execution
      token_budget: 16384        # padded tokens per micro-step
      transport: mooncake        # or mpi
      backend: megatron          # or torch (the default)
      dtype: bfloat16            # the model's parameters (auto: bfloat16 on cuda, else float32)
      parallel: {tensor: 2}      # a cell's ranks: tensor x pipeline x data (ParallelDims)

Its parts (`ObjectiveConfig`, `OptimConfig`, admission, advantages, the packing buffer's
`StreamConfig`) are derived from it, so there is one source for each value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gyre.errors import ConfigError
from gyre.train.admission import DEFAULT_ROLE_PRIORITY, AdmissionConfig
from gyre.train.rewards import AdvantageConfig
from gyre.train.stream import StreamConfig

DTYPES = ("auto", "float32", "bfloat16")
"""`train.dtype`'s allowed values."""
LR_SCHEDULES = ("constant", "linear_warmup", "cosine")
"""`train.lr_schedule`'s allowed values."""


@dataclass(kw_only=True)
class ObjectiveConfig:
    """Parameters of the execution-level GSPO objective."""

    token_weight_cap: float = 5.0
    """Cap on the token importance weight exp(l_t - b_t)."""
    clip_low: float = 0.995
    """Lower sequence-ratio clipping bound (applies when A_i < 0)."""
    clip_high: float = 1.005
    """Upper sequence-ratio clipping bound (applies when A_i > 0)."""
    token_weight: Literal["capped_token_ratio", "sequence_ratio"] = "capped_token_ratio"
    """Per-token magnitude: the capped token ratio (Gyre) or the sequence ratio (plain GSPO)."""

    def __post_init__(self) -> None:
        if not self.token_weight_cap > 0:
            raise ConfigError(f"token_weight_cap: {self.token_weight_cap!r}; allowed > 0")
        if not 0 < self.clip_low <= 1 <= self.clip_high:
            raise ConfigError(
                f"clip_low/clip_high: {self.clip_low!r}/{self.clip_high!r}; "
                "allowed 0 < clip_low <= 1 <= clip_high"
            )
        if self.token_weight not in ("capped_token_ratio", "sequence_ratio"):
            raise ConfigError(
                f"token_weight: {self.token_weight!r}; allowed capped_token_ratio, sequence_ratio"
            )


@dataclass(kw_only=True)
class OptimConfig:
    """The core's optimizer (paper appendix defaults)."""

    lr: float = 1e-6
    """Peak learning rate (the whole run's with `lr_schedule: constant`)."""
    lr_schedule: Literal["constant", "linear_warmup", "cosine"] = "constant"
    """How the learning rate moves over the run's updates (`lr_at`): constant; linear_warmup
    (lr * n / warmup_steps for the n-th update up to warmup_steps, then lr); cosine (the same
    warmup, then a half cosine from lr down to min_lr, reached at update decay_steps)."""
    warmup_steps: int = 0
    """Updates of linear warmup (linear_warmup: >= 1; cosine: >= 0; constant: 0)."""
    min_lr: float = 0.0
    """cosine: the learning rate at update decay_steps and after (0 <= min_lr <= lr)."""
    decay_steps: int | None = None
    """cosine: the update (counted from the run's first) at which lr reaches min_lr; null:
    the run's `steps`, so its last update uses min_lr."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-15
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""
    grad_clip: float = 1.0
    """Clip the batch gradient to this global L2 norm (0 = no clipping)."""

    def __post_init__(self) -> None:
        for name in ("lr", "eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: {getattr(self, name)!r}; allowed > 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r}; allowed 0 <= value < 1")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("weight_decay/grad_clip: must be >= 0")
        self._check_schedule()

    def _check_schedule(self) -> None:
        """`lr_schedule` and the keys it reads, each used only where it means something."""
        kind = self.lr_schedule
        if kind not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule: {kind!r}; allowed {', '.join(LR_SCHEDULES)}")
        low = 1 if kind == "linear_warmup" else 0
        high = 0 if kind == "constant" else None
        if self.warmup_steps < low or (high is not None and self.warmup_steps > high):
            allowed = "0 (no warmup with a constant lr)" if high == 0 else f"an integer >= {low}"
            raise ConfigError(
                f"warmup_steps: {self.warmup_steps} with lr_schedule {kind}; allowed {allowed}"
            )
        if kind != "cosine" and (self.min_lr != 0 or self.decay_steps is not None):
            raise ConfigError(
                f"min_lr/decay_steps: {self.min_lr!r}/{self.decay_steps!r} with lr_schedule "
                f"{kind}; allowed only with lr_schedule cosine"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr: {self.min_lr!r}; allowed 0 <= min_lr <= lr ({self.lr!r})")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"decay_steps: {self.decay_steps}; allowed an integer > warmup_steps "
                f"({self.warmup_steps}), or null (the run's steps)"
            )

    def lr_at(self, update: int, steps: int) -> float:
        """The learning rate of update `update` (0-based: updates done before it) of a run of
        `steps` updates — the one schedule both training backends step with, a resumed run
        at its resumed update. Pure: no clock, no state."""
        if update < 0:
            raise ValueError(f"update: {update}; allowed >= 0")
        n = update + 1  # the n-th update
        if n <= self.warmup_steps:
            return self.lr * n / self.warmup_steps
        if self.lr_schedule != "cosine":
            return self.lr
        end = self.decay_steps if self.decay_steps is not None else steps
        span = end - self.warmup_steps  # <= 0: a run shorter than its warmup
        done = min(1.0, (n - self.warmup_steps) / span) if span > 0 else 1.0
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))


@dataclass(kw_only=True)
class ParallelConfig:
    """How one cell's ranks share its training replica: tensor x pipeline x data = ranks.

    Unset sizes are derived from `topology.ranks_per_cell` by the training backend's `dims`
    (`gyre.train.backends`): the torch backend is data parallel inside a cell (every rank a
    whole replica, rows split); the Megatron backend shards the model over the cell with
    tensor and pipeline parallelism, `data` replicas of it side by side (data parallelism
    runs across cells too, between the core and its satellites).
    """

    tensor: int | None = None
    """Tensor-parallel size of a cell (megatron; null: ranks_per_cell / (pipeline x data))."""
    pipeline: int = 1
    """Pipeline-parallel size of a cell (megatron; divides the model's layers)."""
    expert: int = 1
    """Expert-parallel size of a cell (megatron, mixture-of-experts models): a stage's routed
    experts split into `expert` blocks over its tensor-parallel ranks, each expert over
    tensor / expert of them; divides tensor and the model's expert count (docs/gpu.md)."""
    data: int | None = None
    """Data-parallel replicas of the model inside a cell, each taking its share of every
    micro-step's rows, their gradients summed in the cell before the cross-cell reduce (null:
    ranks_per_cell / (tensor x pipeline) with megatron where tensor is set, else 1; torch:
    every rank, ranks_per_cell)."""
    sequence: bool | None = None
    """Megatron's sequence parallelism beside tensor parallelism: the activations outside the
    tensor-parallel layers (norms, residuals, dropout) split over the TP ranks along the
    sequence, so they take 1/tensor of the memory, for the same traffic (an all-gather and a
    reduce-scatter where TP alone all-reduces); required by mixture-of-experts models at
    tensor > 1. Null: on when tensor > 1 (megatron; true with tensor 1 is an error)."""

    def __post_init__(self) -> None:
        if self.tensor is not None and self.tensor < 1:
            raise ConfigError(f"tensor: {self.tensor}; allowed an integer >= 1 or null")
        if self.pipeline < 1:
            raise ConfigError(f"pipeline: {self.pipeline}; allowed an integer >= 1")
        if self.expert < 1:
            raise ConfigError(f"expert: {self.expert}; allowed an integer >= 1")
        if self.data is not None and self.data < 1:
            raise ConfigError(f"data: {self.data}; allowed an integer >= 1 or null")
        if self.sequence and self.tensor == 1:
            raise ConfigError(SEQUENCE_NEEDS_TP)


SEQUENCE_NEEDS_TP = ("sequence: true with tensor 1; allowed: true with tensor > 1, or false / "
                     "null (sequence parallelism splits the sequence over the TP ranks)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """A cell's parallel sizes, validated: tensor x pipeline x data = ranks of the cell."""

    tensor: int
    pipeline: int
    data: int
    sequence: bool = False
    """Sequence parallelism beside tensor parallelism (`ParallelConfig.sequence`, resolved)."""
    expert: int = 1
    """Expert parallelism folded onto the tensor-parallel ranks (`ParallelConfig.expert`)."""

    def __post_init__(self) -> None:
        if self.sequence and self.tensor == 1:
            raise ConfigError(f"parallel.{SEQUENCE_NEEDS_TP}")
        if self.tensor % self.expert:
            raise ConfigError(f"parallel.expert: {self.expert} does not divide tensor "
                              f"{self.tensor}; allowed: a divisor of {self.tensor} (experts are "
                              "folded onto the tensor-parallel ranks)")  # fmt: skip

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the model: tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def splits_rows(self) -> bool:
        """Whether a micro-step's rows are split over the cell's replicas (data parallel)."""
        return self.data > 1

    def place(self, shard: int) -> RankPlace:
        """Where cell rank `shard` sits: shard = tensor + TP x (stage + PP x replica), the
        tensor-parallel rank fastest, as Megatron's "tp-cp-ep-pp-dp" order numbers a world
        whose cells are contiguous blocks of ranks (so a cell's replicas stay inside it)."""
        if not 0 <= shard < self.ranks:
            raise ValueError(f"shard: {shard}; allowed 0..{self.ranks - 1}")
        data, position = divmod(shard, self.model_parallel)
        return RankPlace(tensor=position % self.tensor, stage=position // self.tensor,
                         data=data, position=position)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RankPlace:
    """A cell rank's place in its cell's layout (`ParallelDims.place`)."""

    tensor: int
    """Its tensor-parallel rank."""
    stage: int
    """Its pipeline stage."""
    data: int
    """Its data-parallel replica inside the cell (0: the one that reduces across cells,
    steps the core's optimizer, writes checkpoint shards and sends the weights)."""
    position: int
    """Its model-parallel position, tensor + TP x stage: its shard of the model, the same in
    every replica."""


@dataclass(kw_only=True)
class TrainConfig(OptimConfig, ObjectiveConfig):
    """The trainer: the run YAML's `train:` section, flat (`train.clip_high`, `train.lr`, ...).

    One place for the objective (its fields: `ObjectiveConfig`), the core's optimizer
    (`OptimConfig`), admission, packing and placement; the cells and the coordinator take
    their parts from it (`objective`, `optim`, `admission`, `advantage`, `stream`).
    Defaults are the paper's (appendix B, §6.1).
    """

    scale_by_std: bool = True
    """Divide centred group rewards by the group's std (GRPO/GSPO); false: Dr.GRPO."""
    j_max: int | None = 5
    """J_max: most trajectories admitted per execution (null: unlimited)."""
    role_priority: list[str] = field(default_factory=lambda: list(DEFAULT_ROLE_PRIORITY))
    """Admission's role classes, highest priority first."""
    token_budget: int = 16384
    """Most padded tokens (rows x longest row) in one micro-step."""
    seed: int = 0
    """Seed of admission sampling and of task-instance draws."""
    device: str = "cpu"
    """Torch device of the cells (cpu, cuda, cuda:N)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The model's parameters, activations and published weights: float32, or bfloat16 with
    Megatron's mixed precision (float32 main weights, gradients accumulated in float32,
    float32 AdamW moments; checkpoints keep the float32 state); auto: bfloat16 on a cuda
    `device`, float32 on cpu (`params_dtype`; docs/training.md "Mixed precision")."""
    transport: Literal["mpi", "mooncake"] = "mpi"
    """How satellites pull the core's weight snapshot."""
    backend: str = "torch"
    """Training backend of the cells, a name in `gyre.train.backends.BACKENDS` (the run config
    checks it): torch (a whole replica per rank, the embedded default) or megatron
    (megatron-core, the model sharded over a cell's ranks; extra `gyre[gpu]`, on CPU through
    gyre.train.megatron.cpu)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How a cell's ranks share its replica (tensor / pipeline sizes; docs/gpu.md)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of a mixture-of-experts model's router load-balancing loss added to the objective
    (Megatron backend: `moe_aux_loss_coeff`; the torch backend adds none); 0: the objective
    alone, the default for RL (docs/gpu.md "Model families")."""
    routing_replay: bool | Literal["auto"] = "auto"
    """Train a mixture-of-experts policy on the experts its rollout engine routed each token
    to: the proxy records them with the tokens (SGLang's `return_routed_experts`), and the
    trainer's routers take them as their top-k (Megatron's router replay slot; the torch
    backend's transformers routers alike), so the trainer's probabilities are those of the
    policy that acted (docs/gpu.md "Routing replay"). auto: on for a MoE model; true
    refuses a dense model."""
    keep_policies: int = 3
    """Publications kept as Hugging Face model directories under RUN_DIR/policies (>= 1)."""
    record_batches: bool = False
    """Write every batch's micro-steps and the core's gradient to RUN_DIR/batches (audits)."""
    min_group_outcomes: int = 2
    """Fewest outcomes usable for a group's advantages (valid scores and failure placeholders;
    excluded executions do not count) for the group to be trained; a group with fewer is set
    aside: it fills its batch slot, trains nothing, and is counted (`set_aside_groups`).
    `schedule.oversample` k > 0 replaces up to k excluded executions per group, so the group
    trains N usable outcomes (docs/scheduler.md "Oversampling")."""
    max_empty_batches: int = 3
    """Consecutive batches with nothing to train (every group set aside, or only placeholders)
    after which the run stops with the executions' errors; each such batch skips its update."""

    def __post_init__(self) -> None:
        OptimConfig.__post_init__(self)
        ObjectiveConfig.__post_init__(self)
        AdmissionConfig(j_max=self.j_max, role_priority=list(self.role_priority))  # validates
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device: {self.device!r}; allowed cpu, cuda, cuda:N")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r}; allowed {', '.join(DTYPES)}")
        if self.token_budget < 1:
            raise ConfigError(f"token_budget: {self.token_budget}; allowed an integer >= 1")
        if not self.moe_aux_loss_coeff >= 0:
            raise ConfigError(
                f"moe_aux_loss_coeff: {self.moe_aux_loss_coeff!r}; allowed a number >= 0"
            )
        if self.routing_replay not in (True, False, "auto"):
            raise ConfigError(f"routing_replay: {self.routing_replay!r}; allowed true, false, auto")
        if self.keep_policies < 1:
            raise ConfigError(f"keep_policies: {self.keep_policies}; allowed an integer >= 1")
        if self.min_group_outcomes < 1:
            raise ConfigError(
                f"min_group_outcomes: {self.min_group_outcomes}; allowed an integer >= 1"
            )
        if self.max_empty_batches < 1:
            raise ConfigError(
                f"max_empty_batches: {self.max_empty_batches}; allowed an integer >= 1"
            )

    @property
    def params_dtype(self) -> Literal["float32", "bfloat16"]:
        """The torch dtype name of the model's parameters: `dtype`, with auto resolved by
        `device` (bfloat16 on cuda, float32 on cpu) — the one place it is resolved."""
        if self.dtype == "auto":
            return "bfloat16" if self.device.startswith("cuda") else "float32"
        return self.dtype

    def replays_routing(self, hf: Mapping[str, Any]) -> bool:
        """Whether a run of the model with config `hf` (config.json as a dict) records and
        replays routed experts: `routing_replay` (auto: for a MoE model)."""
        moe = bool(hf.get("num_experts") or hf.get("num_local_experts"))
        return moe and self.routing_replay in (True, "auto")

    @property
    def objective(self) -> ObjectiveConfig:
        """The execution-level GSPO objective's parameters (this config is one)."""
        return self

    @property
    def optim(self) -> OptimConfig:
        """The core's AdamW (this config is one)."""
        return self

    @property
    def admission(self) -> AdmissionConfig:
        """The admission rule (J_max, role priority)."""
        return AdmissionConfig(j_max=self.j_max, role_priority=list(self.role_priority))

    @property
    def advantage(self) -> AdvantageConfig:
        """Group-relative advantage normalization."""
        return AdvantageConfig(scale_by_std=self.scale_by_std)

    def stream(self, *, groups_per_batch: int, group_size: int) -> StreamConfig:
        """The packing buffer's config for a batch shape (B groups of N executions)."""
        return StreamConfig(
            groups_per_batch=groups_per_batch, group_size=group_size,
            token_budget=self.token_budget, seed=self.seed, admission=self.admission,
            advantage=self.advantage, min_outcomes=self.min_group_outcomes,
        )  # fmt: skip
