"""Typed configuration of the training plane (no torch import: safe for CLI modules).

`TrainConfig` gathers the trainer's parts; each part validates itself in `__post_init__` and
`gyre.config.load(TrainConfig, data, path="train")` reports unknown keys and bad values with
their key path:

    train:
      transport: mooncake        # or mpi
      stream: {groups_per_batch: 32, group_size: 16, token_budget: 16384,
               admission: {j_max: 5, role_priority: [main, compaction, subagent]}}
      objective: {token_weight_cap: 5.0, clip_low: 0.995, clip_high: 1.005}
      optim: {lr: 1.0e-6, beta1: 0.9, beta2: 0.95, eps: 1.0e-15, weight_decay: 0.01}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gyre.errors import ConfigError
from gyre.train.stream import StreamConfig


@dataclass(kw_only=True, slots=True)
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


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The core's optimizer (paper appendix defaults)."""

    lr: float = 1e-6
    """Constant learning rate."""
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


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the streaming trainer needs."""

    stream: StreamConfig = field(default_factory=StreamConfig)
    """Batch shape, packing, admission and advantages."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The execution-level GSPO objective."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The core's optimizer."""
    transport: Literal["mooncake", "mpi"] = "mooncake"
    """How satellites pull the core's weight snapshot."""
    device: str = "cpu"
    """Torch device of the cells ("cpu", "cuda", "cuda:0", ...)."""

    def __post_init__(self) -> None:
        if self.transport not in ("mooncake", "mpi"):
            raise ConfigError(f"transport: {self.transport!r}; allowed mooncake, mpi")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device: {self.device!r}; allowed cpu, cuda, cuda:N")
