"""Admission sampling (§5.3): which trajectories of an execution's tree become training data.

The procedure, exactly as the paper states it:

1. Start from the provenance mask: only policy-sampled tokens (a node's `output_ids`) are
   eligible targets; everything else is context.
2. Repeatedly take the highest-priority role class that still has a leaf with unmasked
   trainable tokens; draw one leaf of that class with probability proportional to its
   unmasked trainable count; fix that trajectory's targets to the tokens still unmasked on its
   root-to-leaf path; mask the whole path.
3. Stop when nothing trainable remains or `j_max` trajectories are admitted.

Masking is per node (a path always masks whole nodes), so a trajectory's targets are "the
trainable tokens of the path nodes not yet masked at its draw": target sets of one execution
are disjoint and a shared prefix is trained at most once. A leaf's class is its leaf node's
role; roles missing from `role_priority` share one class ranked after all listed roles.

The draw is seeded: `admit(tree, config=cfg, seed=s)` is a pure function of its inputs.

    adm = AdmissionTree.from_tree(tree)
    picked = admit(adm, config=AdmissionConfig(j_max=5), seed=derive_seed(7, tree.execution_id))
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import ConfigError, TrainingError

DEFAULT_ROLE_PRIORITY = ("main", "compaction", "subagent", "subagent-compaction")


@dataclass(kw_only=True, slots=True)
class AdmissionConfig:
    """Admission rule parameters."""

    j_max: int | None = 5
    """Most trajectories admitted per execution; None = unlimited (admit until none remain)."""
    role_priority: list[str] = field(default_factory=lambda: list(DEFAULT_ROLE_PRIORITY))
    """Role classes, highest priority first; unlisted roles form one class after these."""

    def __post_init__(self) -> None:
        if self.j_max is not None and (not isinstance(self.j_max, int) or self.j_max < 1):
            raise ConfigError(f"j_max: {self.j_max!r}; allowed an int >= 1 or null (unlimited)")
        if len(set(self.role_priority)) != len(self.role_priority):
            raise ConfigError(f"role_priority: {self.role_priority!r} repeats a role")


@dataclass(frozen=True, slots=True)
class AdmissionTree:
    """The shape admission needs: parent, role and trainable-token count of nodes 1..n."""

    parent: tuple[int, ...]
    role: tuple[str, ...]
    trainable: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.parent)
        if len(self.role) != n or len(self.trainable) != n:
            raise TrainingError("admission tree: parent/role/trainable lengths differ")
        for i, p in enumerate(self.parent, start=1):
            if not 0 <= p < i:
                raise TrainingError(f"admission tree: node {i} has parent {p}; allowed 0..{i - 1}")
        if any(c < 0 for c in self.trainable):
            raise TrainingError("admission tree: trainable counts must be >= 0")

    @classmethod
    def from_tree(cls, tree: Any) -> AdmissionTree:
        """From a `TrajectoryTree`: trainable tokens are the POLICY-provenance outputs."""
        nodes = tree.nodes
        return cls(
            parent=tuple(int(n.parent_id) for n in nodes),
            role=tuple(str(n.role) for n in nodes),
            trainable=tuple(len(n.output_ids) for n in nodes),
        )

    def leaves(self) -> list[int]:
        """Nodes without children, in id order."""
        has_child = set(self.parent)
        return [i for i in range(1, len(self.parent) + 1) if i not in has_child]

    def path(self, node_id: int) -> list[int]:
        """Root-exclusive path to `node_id`, root first."""
        out: list[int] = []
        while node_id:
            out.append(node_id)
            node_id = self.parent[node_id - 1]
        return out[::-1]


@dataclass(frozen=True, slots=True)
class Admitted:
    """One admitted trajectory: its leaf and the path nodes whose outputs are its targets."""

    leaf: int
    target_nodes: tuple[int, ...]
    num_targets: int


def derive_seed(seed: int, execution_id: str) -> int:
    """A per-execution seed independent of processing order."""
    digest = hashlib.sha256(f"{seed}:{execution_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _class_rank(role: str, priority: Sequence[str]) -> int:
    try:
        return priority.index(role)
    except ValueError:
        return len(priority)


def _unmasked_counts(tree: AdmissionTree, paths: dict[int, list[int]], masked: set[int]):
    return {
        leaf: sum(tree.trainable[n - 1] for n in path if n not in masked)
        for leaf, path in paths.items()
    }


def _draw(candidates: list[tuple[int, int]], rng: random.Random) -> int:
    """One leaf with probability proportional to its count (candidates in leaf order)."""
    total = sum(c for _, c in candidates)
    x = rng.random() * total
    for leaf, c in candidates:
        if x < c:
            return leaf
        x -= c
    return candidates[-1][0]


def admit(tree: AdmissionTree, *, config: AdmissionConfig, seed: int) -> list[Admitted]:
    """Run the admission procedure; returns admitted trajectories in draw order."""
    rng = random.Random(seed)
    paths = {leaf: tree.path(leaf) for leaf in tree.leaves()}
    rank = {leaf: _class_rank(tree.role[leaf - 1], config.role_priority) for leaf in paths}
    masked: set[int] = set()
    out: list[Admitted] = []
    while config.j_max is None or len(out) < config.j_max:
        counts = _unmasked_counts(tree, paths, masked)
        live = [leaf for leaf, c in counts.items() if c > 0]
        if not live:
            break
        best = min(rank[leaf] for leaf in live)
        leaf = _draw([(lf, counts[lf]) for lf in live if rank[lf] == best], rng)
        targets = tuple(n for n in paths[leaf] if n not in masked and tree.trainable[n - 1] > 0)
        out.append(Admitted(leaf=leaf, target_nodes=targets, num_targets=counts[leaf]))
        masked.update(paths[leaf])
    return out
