"""Learning works: the tiny model raises a synthetic reward through the whole training plane.

Executions are sampled from the current policy (plain torch sampler, behaviour log-probs
recorded), recorded as trajectory trees, scored, admitted, packed and trained with the
execution-level objective and the core's Adam. The sampler draws from the policy restricted to
token ids 0..15 (constrained decoding; the recorded log-probs are the full-vocabulary ones the
trainer recomputes); reward: the fraction of sampled ids in {0, 1, 2, 3} (~0.25 at the start).
"""

from __future__ import annotations

import numpy as np
import torch
from reference import train_batch_reference

from gyre.train.cell import CoreOptimizer, OptimConfig, TorchCell
from gyre.train.objective import ObjectiveConfig
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.train.stream import ReadyGroup, StreamConfig, StreamPackingBuffer
from gyre.trajectory.tree import Provenance, TrajectoryTree

N, B, NEW, STEPS, ALLOWED = 8, 2, 8, 10, 16


@torch.no_grad()
def _sample(model, prompt: torch.Tensor, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    ids, lps = prompt[None], []
    for _ in range(NEW):
        logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
        tok = torch.multinomial(logp[:ALLOWED].exp(), 1, generator=gen)
        lps.append(float(logp[tok]))
        ids = torch.cat([ids, tok[None]], dim=1)
    return ids[0, len(prompt) :].numpy(), np.asarray(lps, np.float32)


def _group(model, version: int, g: int, gen: torch.Generator, vocab: int):
    outcomes, trees, rewards = [], {}, []
    prompt = torch.randint(0, vocab, (6,), generator=gen)
    for i in range(N):
        out, lps = _sample(model, prompt, gen)
        eid = f"v{version}-g{g}-e{i}"
        tree = TrajectoryTree(eid)
        tree.add_node(parent_id=0, input_ids=prompt.numpy(),
                      input_provenance=np.full(6, Provenance.USER, np.uint8), output_ids=out,
                      output_logprobs=lps, role="main", policy_version=version, engine_id="t",
                      t_start=0.0, t_end=1.0, finish_reason="length", input_key=b"i",
                      output_key=b"o")  # fmt: skip
        reward = float(np.mean(out < 4))
        rewards.append(reward)
        outcomes.append(ExecutionOutcome(execution_id=eid, status=Status.VALID, reward=reward))
        trees[eid] = tree
    return ReadyGroup(group_id=f"{version}-{g}", policy_version=version, outcomes=outcomes,
                      trees=trees), float(np.mean(rewards))  # fmt: skip


def test_mean_reward_improves() -> None:
    from gyre.models import load_model

    torch.manual_seed(0)
    model = load_model("tiny")[0]
    vocab = model.config.vocab_size
    objective = ObjectiveConfig()
    cell = TorchCell(model, objective=objective)
    opt = CoreOptimizer(cell, OptimConfig(lr=1e-2))
    buf = StreamPackingBuffer(StreamConfig(groups_per_batch=B, group_size=N, token_budget=512))
    gen = torch.Generator().manual_seed(1)
    history = []
    for version in range(STEPS):
        means = []
        for g in range(B):
            group, mean = _group(model, version, g, gen, vocab)
            buf.add_ready(group)
            means.append(mean)
        history.append(float(np.mean(means)))
        buf.begin_batch()
        steps = []
        while not buf.closed:
            steps += buf.pull()
        train_batch_reference([cell], opt, steps, buf.batch_info(), objective=objective)
    first, last = np.mean(history[:3]), np.mean(history[-3:])
    assert last > first + 0.3, history
