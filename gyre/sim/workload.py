"""Synthetic xLong workload: how long executions run, how they end, what training costs.

Every number here is a documented parameter of `WorkloadConfig` (docs/simulator.md explains
the NL2RepoBench calibration). Durations are *nominal*: wall time at the reference load
(every engine at its concurrency limit, as in the paper's runs). The simulator stretches or
shrinks the generation part with the engine's actual load.

Per group (query): difficulty q = median * exp(σ_q Z) and, with probability p_hard, times
hard_factor (hard queries are where clustered timeouts come from). Per execution: noise
exp(σ_e Z) and, with probability tail_prob, a Pareto(tail_alpha) factor (heavy tail).
Evaluation: attempts of eval_minutes that fail with eval_fail_prob and are retried while the
overall budget (overall_timeout_h from launch) lasts; an execution without a valid score by
then is discarded (an *overall timeout*).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.errors import ConfigError

HOUR = 3600.0


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    """Duration, timeout, evaluation and token model of the executions."""

    query_median_h: float = 1.75
    """Median nominal execution time of an ordinary query, hours."""
    query_sigma: float = 0.15
    """σ_q: log-normal spread of difficulty across queries."""
    hard_query_prob: float = 0.07
    """Probability that a query is hard (its executions cluster at the timeout)."""
    hard_query_factor: float = 3.0
    """Difficulty multiplier of a hard query."""
    execution_sigma: float = 0.25
    """σ_e: log-normal spread across the N executions of one query."""
    tail_prob: float = 0.0
    """Probability of an extra Pareto heavy-tail factor on one execution."""
    tail_alpha: float = 1.5
    """Pareto shape of that factor (smaller = heavier)."""
    generation_share: float = 0.6
    """Share of nominal time spent waiting for model calls (the rest is tool time)."""
    saturation_half_per_node: float = 36.0
    """Load per engine node at which per-call generation time doubles (throughput
    saturation); an engine of n nodes saturates at n times this (one model per size)."""
    harness_timeout_h: float = 4.0
    """Harness timeout from launch; the execution is killed and still scored."""
    overall_timeout_h: float = 4.5
    """Overall budget from launch, evaluation included; past it the execution is discarded."""
    eval_minutes: float = 10.0
    """Duration of one evaluation attempt."""
    eval_fail_prob: float = 0.5
    """Probability that an evaluation attempt fails and is retried."""
    train_tokens_per_hour: float = 160_000.0
    """Admitted training tokens (rows of ≤ J_max trajectories) per hour of execution work."""
    tokens_sigma: float = 0.0
    """Log-normal spread of an execution's tokens around that (sampled at dispatch)."""

    def __post_init__(self) -> None:
        for name in ("query_median_h", "hard_query_factor", "tail_alpha",
                     "saturation_half_per_node"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: {getattr(self, name)}; allowed > 0")
        for name in ("query_sigma", "execution_sigma", "eval_minutes", "train_tokens_per_hour",
                     "tokens_sigma"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: {getattr(self, name)}; allowed >= 0")
        for name in ("hard_query_prob", "tail_prob", "generation_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name}: {getattr(self, name)}; allowed 0..1")
        if not 0 <= self.eval_fail_prob < 1:
            raise ConfigError(f"eval_fail_prob: {self.eval_fail_prob}; allowed 0 <= p < 1")
        if not 0 < self.harness_timeout_h <= self.overall_timeout_h:
            raise ConfigError(
                f"harness_timeout_h: {self.harness_timeout_h}; allowed 0 < harness_timeout_h "
                f"<= overall_timeout_h ({self.overall_timeout_h})"
            )


@dataclass(frozen=True, slots=True)
class GroupSample:
    """What the workload decides for one group at dispatch."""

    nominal_s: np.ndarray
    """Nominal run time of each execution, seconds (before the harness timeout)."""
    eval_s: np.ndarray
    """Total evaluation time until the first valid score (if the budget allows)."""
    tokens: np.ndarray
    """Training tokens of each execution if it runs to its end (a timeout trains on the
    share of its work done)."""


class Workload:
    """Draws groups from one seeded generator; same seed, same draws."""

    def __init__(self, config: WorkloadConfig, group_size: int, seed: int) -> None:
        self.config = config
        self.n = group_size
        self.rng = np.random.default_rng(seed)

    def sample_group(self) -> GroupSample:
        cfg, n, rng = self.config, self.n, self.rng
        q = cfg.query_median_h * np.exp(cfg.query_sigma * rng.standard_normal())
        if rng.random() < cfg.hard_query_prob:
            q *= cfg.hard_query_factor
        noise = np.exp(cfg.execution_sigma * rng.standard_normal(n))
        tail = rng.random(n) < cfg.tail_prob
        noise = np.where(tail, noise * (1.0 + rng.pareto(cfg.tail_alpha, n)), noise)
        attempts = rng.geometric(1.0 - cfg.eval_fail_prob, n)
        nominal = q * noise
        tokens = cfg.train_tokens_per_hour * nominal
        if cfg.tokens_sigma > 0:
            tokens = tokens * np.exp(cfg.tokens_sigma * rng.standard_normal(n))
        return GroupSample(
            nominal_s=nominal * HOUR, eval_s=attempts * cfg.eval_minutes * 60.0, tokens=tokens
        )


class EmpiricalWorkload:
    """Recorded groups drawn with replacement (trace replay); same seed, same draws.

    `in_order`: the groups in their given order instead (the run's dispatch order), then
    again from the first, so a replay meets the run's own sequence of long and short groups.
    """

    def __init__(self, groups: list[GroupSample], seed: int, in_order: bool = False) -> None:
        if not groups:
            raise ValueError("an empirical workload needs at least one recorded group")
        self.groups = groups
        self.rng = np.random.default_rng(seed)
        self.in_order = in_order
        self.drawn = 0

    def sample_group(self) -> GroupSample:
        if self.in_order:
            self.drawn += 1
            return self.groups[(self.drawn - 1) % len(self.groups)]
        return self.groups[int(self.rng.integers(len(self.groups)))]


def nominal_stats(config: WorkloadConfig, group_size: int, groups: int, seed: int) -> dict:
    """Execution/query statistics at the reference load (all launched together).

    Used to calibrate a template against measured figures (docs/simulator.md).
    """
    wl = Workload(config, group_size, seed)
    th, to = config.harness_timeout_h * HOUR, config.overall_timeout_h * HOUR
    samples = [wl.sample_group() for _ in range(groups)]
    run = np.array([np.minimum(s.nominal_s, th) for s in samples])
    nominal = np.array([s.nominal_s for s in samples])
    evals = np.array([s.eval_s for s in samples])
    query = run.max(axis=1)
    return {
        "mean_execution_h": float(run.mean() / HOUR),
        "mean_query_h": float(query.mean() / HOUR),
        "queries_over_4h": float((query >= 4 * HOUR - 1e-6).mean()),
        "harness_timeouts": float((nominal > th).mean()),
        "overall_timeouts": float((run + evals > to).mean()),
    }
