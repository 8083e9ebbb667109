"""Routing replay (issue 54, item 4): the trainer routes each position as the engine did.

A tiny random Qwen3-MoE (megatron_family_worker's `tiny_family`, renormalized top 2 of 32
experts, so a layer leaves some expert unchosen) serves a two-call execution in the embedded engine, which reports each position's
routed experts (`return_routed_experts`); the calls become a trajectory tree whose nodes hold
them (`Node.routed_experts`, asked from the position before each node's first token, as the
proxy asks), the leaf's row carries them per position (`TokenRow.routing`), and a cell
built from the same weights computes the row's target log-probs: the Megatron backend's
(megatron-core's router replay slot) and the torch backend's (transformers' routers, hooked).

Then one router of the trainer changes where the engine's routing never looked: an expert
the engine chose for no position of that layer is made to score 60 times another's. Its own
router now sends positions there, and its log-probs move away from the engine's; replaying
the recorded routing they stay the engine's (the replayed experts' weights come from their
unchanged scores). On the unchanged model both agree, replay or not.
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gyre.models import tiny_tokenizer
from gyre.rollout.engine import Config, Engine
from gyre.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams
from gyre.rollout.routed import node_rows
from gyre.train.packing import MicroStep, make_row
from gyre.trajectory.tree import Provenance, TrajectoryTree

sys.path.insert(0, str(Path(__file__).parent))
from megatron_family_worker import tiny_family

TOP_K = 2


def _generate(engine: Engine, ids: list[int], routed_from: int) -> GenerateResult:
    done, out = threading.Event(), {}
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, sampling_seed=7)
    req = GenerateRequest(rid=f"r{len(ids)}", input_ids=ids, sampling=sp, return_logprob=True,
                          return_routed_experts=True, routed_experts_start_len=routed_from)  # fmt: skip

    def deliver(body: dict[str, Any]) -> None:
        out["body"] = body
        done.set()

    engine.submit(req, deliver)
    assert done.wait(timeout=120), "the engine did not answer"
    return GenerateResult.from_response(out["body"], routed_from)


def _execution(hf: torch.nn.Module) -> TrajectoryTree:
    """Two calls of one execution served by the engine, recorded as the proxy records them."""
    engine = Engine(Config(prefix_cache_mb=0), copy.deepcopy(hf).eval(), tiny_tokenizer())
    engine.start()
    tree = TrajectoryTree("x")
    try:
        parent, new_inputs = 0, ([3, 14, 15, 92, 65, 35, 89, 79], [32, 38, 46])
        for n, new in enumerate(new_inputs):
            before = tree.full_ids(parent).tolist()  # the parent's whole path
            res = _generate(engine, before + new, max(len(before) - 1, 0))
            assert res.routed_experts is not None
            node = tree.add_node(
                parent_id=parent, input_ids=new, input_provenance=[Provenance.USER] * len(new),
                output_ids=res.output_ids, output_logprobs=res.output_logprobs, role="main",
                policy_version=0, engine_id="e0", t_start=0.0, t_end=1.0, finish_reason="length",
                input_key=bytes([n]), output_key=bytes([n, 1]),
                routed_experts=node_rows(res.routed_experts, TOP_K, at_root=not before),
            )  # fmt: skip
            parent = node.node_id
    finally:
        engine.stop()
    return tree


def _trainer(hf: torch.nn.Module) -> Any:
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore
    from gyre.train.objective import ObjectiveConfig

    hfc = hf.config.to_dict()
    shard = stage_to_mcore(dict(hf.state_dict()), WeightLayout.from_hf_config(hfc), tp_rank=0,
                           tp_size=1, stage=0, stages=1)  # fmt: skip
    model = build_rank_model(hfc, shard, MegatronConfig(dtype="float32"), device="cpu")
    return MegatronCell(model, objective=ObjectiveConfig())


def _logprobs(cell: Any, tree: TrajectoryTree, *, replay: bool) -> tuple[np.ndarray, np.ndarray]:
    """(trainer's, engine's) log-probs of the leaf row's targets."""
    pt = tree.materialize(tree.leaves()[0])
    row = make_row(execution_id="x", group_id="g", policy_version=0, ids=pt.ids,
                   targets=pt.trainable, behaviour_logprobs=pt.logprobs, advantage=1.0,
                   execution_targets=int(pt.trainable.sum()),
                   routing=pt.routing if replay else None)  # fmt: skip
    with torch.no_grad():
        logp, st = cell._logprobs(MicroStep(index=0, rows=(row,)), grad=False)
    return logp[0][st.targets[0]].numpy(), pt.logprobs[pt.trainable]


def _router_weight(cell: Any, layer: int) -> torch.Tensor:
    if hasattr(cell.model, "decoder"):  # Megatron's GPTModel
        return cell.model.decoder.layers[layer].mlp.router.weight
    return cell.model.model.layers[layer].mlp.gate.weight  # transformers'


@pytest.mark.parametrize("backend", ["megatron", "torch"])
def test_the_trainer_replays_the_engines_routing(megatron_world: None, backend: str) -> None:
    hf = tiny_family("qwen3_moe", experts=32)
    tree = _execution(hf)
    routing = tree.materialize(tree.leaves()[0]).routing
    assert routing is not None and (routing[:-1] >= 0).all(), "a position without routing"
    assert (routing[-1] == -1).all()  # the last position predicts nothing

    if backend == "megatron":
        cell = _trainer(hf)
    else:  # the torch backend: transformers' model in a TorchCell
        from gyre.train.cell import TorchCell
        from gyre.train.objective import ObjectiveConfig

        cell = TorchCell(copy.deepcopy(hf).train(), objective=ObjectiveConfig())
    for replay in (True, False):  # the same policy: the engine's log-probs either way
        trainer, engine = _logprobs(cell, tree, replay=replay)
        np.testing.assert_allclose(trainer, engine, atol=2e-5, rtol=0)

    # an expert the engine never chose in some layer scores far above another there
    layer, unused = next((layer, e) for layer in range(routing.shape[1]) for e in range(32)
                         if not (routing[:, layer] == e).any())  # fmt: skip
    weight = _router_weight(cell, layer)
    used = int(np.bincount(routing[:-1, layer].ravel()).argmax())
    with torch.no_grad():
        weight[unused] = 60 * weight[used]
    replayed, engine = _logprobs(cell, tree, replay=True)
    own, _ = _logprobs(cell, tree, replay=False)
    np.testing.assert_allclose(replayed, engine, atol=2e-5, rtol=0)
    assert np.abs(own - engine).max() > 1e-2, "the changed router routed as the engine did"


def test_rows_of_one_step_with_and_without_routing_pad_with_unknown() -> None:
    from gyre.errors import TrainingError
    from gyre.train.packing import step_routing

    def step(*routings: np.ndarray | None) -> MicroStep:
        rows = tuple(make_row(execution_id=f"e{i}", group_id="g", policy_version=0,
                              ids=[1, 2, 3], targets=[False, True, True],
                              behaviour_logprobs=[0.0, -1.0, -1.0], advantage=1.0,
                              execution_targets=2, routing=r)
                     for i, r in enumerate(routings))  # fmt: skip
        return MicroStep(index=0, rows=rows)

    a = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    got = step_routing(step(a, None), 4)
    assert got is not None and got.shape == (2, 4, 2, 2)
    assert (got[0, :3] == a).all() and (got[0, 3:] == -1).all() and (got[1] == -1).all()
    assert step_routing(step(None, None), 4) is None
    with pytest.raises(TrainingError, match="shapes"):
        step_routing(step(a, np.zeros((3, 3, 2), np.int16)), 4)


@pytest.fixture(scope="module")
def forced_step() -> MicroStep:
    """Rows of the tiny Qwen3-MoE (4 experts) whose positions are routed to experts drawn at
    random (not the routers' choice)."""
    from dataclasses import replace

    from test_gpu_megatron_families import _step

    gen = np.random.default_rng(3)

    def drawn(n: int) -> np.ndarray:  # [positions, layers, top_k], distinct experts
        return np.array([[gen.permutation(4)[:TOP_K] for _ in range(2)] for _ in range(n)],
                        np.int16)  # fmt: skip

    step = _step(tiny_family("qwen3_moe").config.vocab_size)
    return MicroStep(index=0, rows=tuple(replace(r, routing=drawn(r.length)) for r in step.rows))


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_every_layout_replays_the_same_routing(
    megatron_world: None, workers: Any, forced_step: MicroStep, tmp_path: Path, tp: int, pp: int
) -> None:
    """Forced routing: at TP 2 (sequence parallel: each rank replays its slice of the padded
    sequence) and over two pipeline stages (each stage its own layers) the ranks' log-probs
    equal a one-rank cell's (TP 1, in this process) with the same routing, which differ from
    the model's own routing's (transformers')."""
    from test_gpu_megatron_families import _run_world

    from gyre.train.objective import step_tensors, target_logprobs

    hf = tiny_family("qwen3_moe")
    with torch.no_grad():
        one, _ = _trainer(hf)._logprobs(forced_step, grad=False)
    for rank in _run_world(workers, tmp_path, forced_step, "qwen3_moe", tp, "sdpa", pp):
        torch.testing.assert_close(rank["logp"].detach(), one, rtol=1e-5, atol=1e-6)
    st = step_tensors(forced_step)
    with torch.no_grad():
        own = target_logprobs(hf(input_ids=st.ids, attention_mask=st.attention).logits, st.ids)
    assert (own - one)[st.targets].abs().max() > 1e-2, "the forced routing was not used"
