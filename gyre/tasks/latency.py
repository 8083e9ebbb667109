"""Artificial tool latency: the per-call delay a harness adds to each tool call (a task's
`tool_latency`, `gyre.tasks.suite`), here apart from the suite so a harness process that
applies it (`gyre.harness.tools`) imports no YAML or suite code at its start."""

from __future__ import annotations

import dataclasses
import math
import random
import zlib
from dataclasses import dataclass
from typing import Any, Literal

from gyre.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class ToolLatency:
    """Artificial latency added to each tool call, to give executions a long tail.

    Besides the per-call draw, a latency may carry the simulator's workload structure
    (`gyre.sim.workload`, same names): a *query* factor exp(N(0, query_sigma)), times
    hard_query_factor with probability hard_query_prob, shared by every execution of a task
    instance (a group), and an *execution* factor exp(N(0, execution_sigma)). Each is drawn
    once, from the query's and the execution's names (`for_execution`), and multiplies every
    call's latency of that execution (before the cap), so hard queries run long together and
    hit the harness timeout together, as on a cluster.
    """

    # distribution: none | fixed (seconds) | uniform (low..high) | lognormal (exp(N(mu, sigma)))
    dist: Literal["none", "fixed", "uniform", "lognormal"] = "none"
    # fixed latency in seconds (dist=fixed)
    seconds: float = 0.0
    # bounds in seconds (dist=uniform)
    low: float = 0.0
    high: float = 0.0
    # log-space mean and std (dist=lognormal)
    mu: float = -3.0
    sigma: float = 1.0
    # cap on one sampled latency, seconds
    max_s: float = 30.0
    # log-normal spread of a query's factor (shared by a group's executions)
    query_sigma: float = 0.0
    # probability that a query is hard, and the factor a hard query's latencies take
    hard_query_prob: float = 0.0
    hard_query_factor: float = 1.0
    # log-normal spread of an execution's own factor
    execution_sigma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("seconds", "low", "high", "sigma", "max_s", "query_sigma",
                     "execution_sigma"):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name}: {value!r} must be a finite number >= 0")
        if not (math.isfinite(self.hard_query_factor) and self.hard_query_factor > 0):
            raise ConfigError(
                f"hard_query_factor: {self.hard_query_factor!r} must be a finite number > 0"
            )
        if not 0 <= self.hard_query_prob <= 1:
            raise ConfigError(f"hard_query_prob: {self.hard_query_prob!r} must be in 0..1")
        if self.high < self.low:
            raise ConfigError(f"high: {self.high!r} must be >= low ({self.low!r})")
        if not math.isfinite(self.mu):
            raise ConfigError(f"mu: {self.mu!r} must be finite")

    def sample(self, rng: random.Random) -> float:
        """One latency in seconds, in [0, max_s]."""
        if self.dist == "fixed":
            value = self.seconds
        elif self.dist == "uniform":
            value = rng.uniform(self.low, self.high)
        elif self.dist == "lognormal":
            value = rng.lognormvariate(self.mu, self.sigma)
        else:
            value = 0.0
        return min(value, self.max_s)

    def factor(self, query: str, execution: str) -> float:
        """The multiplier of one execution's latencies: its query's and its own factor."""
        q = random.Random(zlib.crc32(f"query/{query}".encode()))
        f = math.exp(self.query_sigma * q.gauss(0.0, 1.0))
        if q.random() < self.hard_query_prob:
            f *= self.hard_query_factor
        e = random.Random(zlib.crc32(f"execution/{query}/{execution}".encode()))
        return f * math.exp(self.execution_sigma * e.gauss(0.0, 1.0))

    def for_execution(self, query: str, execution: str) -> ToolLatency:
        """This latency as one execution of `query` sees it: the factors folded into the
        per-call distribution (the result has none left to draw)."""
        f = self.factor(query, execution)
        return dataclasses.replace(
            self, seconds=self.seconds * f, low=self.low * f, high=self.high * f,
            mu=self.mu + math.log(f), query_sigma=0.0, hard_query_prob=0.0,
            hard_query_factor=1.0, execution_sigma=0.0,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
