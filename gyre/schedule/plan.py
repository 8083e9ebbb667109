"""Turn a target mean scheduling staleness E[d] into (φ, μ) for each policy.

Boundary dispatch gives E[d] = φ + (μ - 1)/2 (paper Eq. 2, proof in its appendix A.2),
whatever the placement policy. The conventions of the paper's Table 2:

* Async: one step per burst, μ = 1, so φ = E[d].
* Colocate: no extra dispatch (it cannot dispatch without interrupting harnesses), φ = 0,
  so μ = 2E[d] + 1, which must be a whole number.
* Elastic: keep at least `min_phi` batches of extra dispatch to absorb stragglers and take
  the longest burst that allows: μ = max(1, ⌊2(E[d] - min_phi)⌋ + 1), φ = E[d] - (μ-1)/2.
  With min_phi = 0.5 this gives the paper's (0.5, 3) at E[d] = 1.5. A target below
  min_phi cannot keep it (μ >= 1): φ = E[d], μ = 1, since policies are compared at the
  same E[d] (paper §6.1), which wins over the minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Plan:
    """Dispatch parameters of one policy."""

    policy: str
    phi: float
    mu: int

    @property
    def staleness(self) -> float:
        return expected_staleness(self.phi, self.mu)


def expected_staleness(phi: float, mu: int) -> float:
    """E[d] = φ + (μ - 1)/2."""
    return phi + (mu - 1) / 2


def plan(staleness: float, min_phi: float = 0.5) -> list[Plan]:
    """(φ, μ) per policy for a target E[d]; raises ConfigError for impossible targets."""
    if not staleness >= 0 or math.isinf(staleness):
        raise ConfigError(f"staleness: {staleness}; allowed: a finite E[d] >= 0")
    if not min_phi >= 0:
        raise ConfigError(f"min_phi: {min_phi}; allowed >= 0")
    plans = [Plan("elastic", *_elastic(staleness, min_phi)), Plan("async", float(staleness), 1)]
    mu = 2 * staleness + 1
    if abs(mu - round(mu)) < 1e-9:
        plans.append(Plan("colocate", 0.0, round(mu)))
    return plans


def plan_for(policy: str, staleness: float, min_phi: float = 0.5) -> Plan:
    """The plan of one policy; Colocate needs 2E[d] + 1 to be a whole number."""
    for p in plan(staleness, min_phi):
        if p.policy == policy:
            return p
    if policy == "colocate":
        raise ConfigError(
            f"staleness: {staleness} needs μ = 2E[d]+1 = {2 * staleness + 1} for Colocate; "
            "allowed: E[d] in steps of 0.5"
        )
    raise ConfigError(f"policy: {policy!r} is unknown; allowed: elastic, async, colocate")


def _elastic(staleness: float, min_phi: float) -> tuple[float, int]:
    if staleness < min_phi:
        return float(staleness), 1
    mu = math.floor(2 * (staleness - min_phi) + 1e-9) + 1
    return staleness - (mu - 1) / 2, mu
