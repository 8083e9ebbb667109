"""Synthetic training data: token rows and branching trajectory trees (tests and benchmarks).

* `random_step` — one micro-step of rows of random ids, each row's second half (or from a
  given position) the target: the Megatron pass tests and `tools/bench_pipeline.py`.
* `random_batch` — rows of several executions with random lengths, targets and behaviour
  log-probs near a given centre, plus the batch's execution table (for objective and
  split-invariance checks).
* `branching_tree` — a real `TrajectoryTree` shaped like an xLong execution: a main agent
  whose context is compacted a few times (each compaction forks a summary leaf and restarts
  under the root) and sub-agents with their own roots, each possibly compacting too.

    rows, info = random_batch(np.random.default_rng(0), executions=6, vocab=4096)
    tree = branching_tree(np.random.default_rng(1), "exec-0", vocab=4096)
"""

from __future__ import annotations

import numpy as np
import torch

from gyre.train.packing import MicroStep, TokenRow, make_row
from gyre.train.stream import BatchInfo
from gyre.trajectory.tree import Provenance, TrajectoryTree


def random_step(
    rng: np.random.Generator, lengths: tuple[int, ...], *, vocab: int, index: int = 0,
    first_target: int | None = None,
) -> MicroStep:  # fmt: skip
    """Micro-step `index`: one row of random ids per length (one execution each, advantage
    1), targets from `first_target` on (None: each row's second half), behaviour log-probs
    -1."""
    rows = []
    for k, n in enumerate(lengths):
        targets = np.arange(n) >= (n // 2 if first_target is None else first_target)
        rows.append(TokenRow(
            execution_id=f"e{index}-{k}", group_id="g0", policy_version=0,
            ids=rng.integers(0, vocab, n).astype(np.int64), targets=targets,
            behaviour_logprobs=np.where(targets, -1.0, 0.0), advantage=1.0,
            execution_targets=int(targets.sum()), weights=targets / targets.sum(),
        ))  # fmt: skip
    return MicroStep(index=index, rows=tuple(rows))


def random_batch(
    rng: np.random.Generator,
    *,
    executions: int,
    vocab: int,
    rows_per_execution: tuple[int, int] = (1, 3),
    length: tuple[int, int] = (8, 40),
    behaviour_centre: float = -8.3,
    behaviour_noise: float = 0.02,
) -> tuple[list[TokenRow], BatchInfo]:
    """Rows of `executions` executions (advantages ~ N(0,1)) and their execution table."""
    rows: list[TokenRow] = []
    table: dict[str, tuple[float, int]] = {}
    for e in range(executions):
        eid, adv = f"e{e}", float(rng.normal())
        n_rows = int(rng.integers(rows_per_execution[0], rows_per_execution[1] + 1))
        shapes = []
        for _ in range(n_rows):
            t = int(rng.integers(length[0], length[1] + 1))
            tg = rng.random(t) < 0.5
            tg[0] = False
            tg[-1] = True
            shapes.append((t, tg))
        total = sum(int(tg.sum()) for _, tg in shapes)
        for t, tg in shapes:
            beh = behaviour_centre + behaviour_noise * rng.normal(size=t)
            rows.append(
                make_row(
                    execution_id=eid,
                    group_id=f"g{e // 4}",
                    policy_version=0,
                    ids=rng.integers(0, vocab, t),
                    targets=tg,
                    behaviour_logprobs=np.where(tg, beh, np.nan),
                    advantage=adv,
                    execution_targets=total,
                )
            )
        table[eid] = (adv, total)
    return rows, BatchInfo(executions=table, group_ids=[], policy_versions=[])


def _add(
    tree: TrajectoryTree,
    rng: np.random.Generator,
    parent: int,
    role: str,
    *,
    n_in: int,
    n_out: int,
    vocab: int,
    prov: Provenance,
) -> int:
    k = len(tree)
    node = tree.add_node(
        parent_id=parent,
        input_ids=rng.integers(0, vocab, n_in),
        input_provenance=np.full(n_in, prov, np.uint8),
        output_ids=rng.integers(0, vocab, n_out),
        output_logprobs=-rng.exponential(1.0, n_out).astype(np.float32),
        role=role,
        policy_version=0,
        engine_id="synthetic",
        t_start=float(k),
        t_end=float(k) + 0.5,
        finish_reason="stop",
        input_key=f"i{k}".encode(),
        output_key=f"o{k}".encode(),
    )
    return node.node_id


def _agent(
    tree: TrajectoryTree,
    rng: np.random.Generator,
    role: str,
    *,
    turns: int,
    compactions: int,
    vocab: int,
    scale: int,
) -> None:
    """One agent: `compactions + 1` segments under the root, each forking a summary leaf."""
    for seg in range(compactions + 1):
        node = _add(
            tree, rng, 0, role, n_in=4 * scale, n_out=scale, vocab=vocab, prov=Provenance.SYSTEM
        )
        for _ in range(turns):
            node = _add(
                tree,
                rng,
                node,
                role,
                n_in=2 * scale,
                n_out=scale,
                vocab=vocab,
                prov=Provenance.TOOL,
            )
        if seg < compactions:  # the prefix forks: a task-driving response and a summary
            _add(tree, rng, node, role, n_in=scale, n_out=scale, vocab=vocab, prov=Provenance.TOOL)
            _add(
                tree, rng, node, f"{role}-compaction" if role != "main" else "compaction",
                n_in=scale // 2 + 1, n_out=scale, vocab=vocab, prov=Provenance.USER,
            )  # fmt: skip


def branching_tree(
    rng: np.random.Generator,
    execution_id: str,
    *,
    vocab: int,
    subagents: int = 3,
    turns: int = 4,
    compactions: int = 2,
    scale: int = 8,
    subagent_turns: int | None = None,
) -> TrajectoryTree:
    """A main agent (`turns` calls per segment) plus `subagents` sub-agents (1..subagent_turns
    calls per segment), each compacting up to `compactions` times."""
    tree = TrajectoryTree(execution_id)
    _agent(tree, rng, "main", turns=turns, compactions=compactions, vocab=vocab, scale=scale)
    for _ in range(subagents):
        _agent(
            tree,
            rng,
            "subagent",
            turns=int(rng.integers(1, (subagent_turns or turns) + 1)),
            compactions=int(rng.integers(0, compactions + 1)),
            vocab=vocab,
            scale=scale,
        )
    return tree


class TinyCausalLM(torch.nn.Module):
    """A seeded one-block causal transformer in plain torch (fast to import in MPI tests).

    Right padding needs no mask: with causal attention a real token never sees later padding.
    """

    def __init__(self, *, vocab: int = 512, dim: int = 32, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)
        )
        self.head = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Logits [n, T, vocab]."""
        del attention_mask
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.mlp(x))
