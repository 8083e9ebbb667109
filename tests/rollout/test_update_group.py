"""The embedded engine's update-group routes (SGLang's /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group), driven by the core's own
`push_weights_distributed`: the broadcast weights are served exactly as a tensor update of the
same weights is, and bodies or sessions the engine cannot take are refused like SGLang's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams, distributed_update_body, tensor_specs
from gyre.rollout.testing import running_engine
from gyre.runtime.cell.engine_host import push_weights
from gyre.runtime.cell.publication import push_weights_distributed

from .conftest import post_json as _post
from .conftest import run

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def own_url() -> Iterator[str]:
    with running_engine("tiny") as url:
        yield url


def _perturbed(model: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=gen))
            for n, p in model.named_parameters()]  # fmt: skip


def _greedy(url: str, prompt: list[int], rid: str) -> Any:
    return run(EngineClient(url).generate(prompt, GREEDY, rid))


def test_broadcast_weights_are_served_like_a_tensor_update(
    own_url: str, prompt: list[int], tiny: Any
) -> None:
    model, _ = tiny
    base = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    new = _perturbed(model, 11)
    before = _greedy(own_url, prompt, "before")
    push_weights(own_url, new, 1, tp_size=1)
    by_tensor = _greedy(own_url, prompt, "by-tensor")
    push_weights(own_url, base, 2, tp_size=1)
    assert _greedy(own_url, prompt, "base-again").output_ids == before.output_ids
    missed = push_weights_distributed([(4, own_url)], new, 3, tp_size=1, host="127.0.0.1")
    by_group = _greedy(own_url, prompt, "by-group")
    assert missed == []
    assert by_group.weight_version == "3" and by_group.output_ids == by_tensor.output_ids
    assert by_group.output_ids != before.output_ids
    assert by_group.output_logprobs == by_tensor.output_logprobs  # the same weights, exactly
    # one group per publication: a second one opens (and leaves) a fresh group
    assert push_weights_distributed([(4, own_url)], base, 4, tp_size=1, host="127.0.0.1") == []
    assert _greedy(own_url, prompt, "base-by-group").output_ids == before.output_ids


def test_a_dead_engine_is_missed_and_the_live_one_is_served(own_url: str, tiny: Any) -> None:
    model, _ = tiny
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    dead = "http://127.0.0.1:9"  # discard port: refused
    missed = push_weights_distributed([(1, dead), (2, own_url)], named, 5, tp_size=1,
                                      host="127.0.0.1")  # fmt: skip
    assert missed == [1]
    assert run(EngineClient(own_url).weight_version()) == "5"


def test_bodies_and_sessions_the_engine_cannot_take_are_refused(own_url: str, tiny: Any) -> None:
    model, _ = tiny
    norm = model.get_parameter("model.norm.weight")
    specs = tensor_specs([("model.norm.weight", norm)])
    body = distributed_update_body(specs, "g", "9")
    status, reply = _post(own_url + "/update_weights_from_distributed", body)
    assert status == 409 and "/begin_weight_update" in reply["message"]  # outside a session
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "nccl"}  # fmt: skip
    status, reply = _post(own_url + "/init_weights_update_group", init)
    assert status == 400 and "allowed gloo" in reply["message"]
    status, reply = _post(own_url + "/init_weights_update_group", {**init, "rank_offset": 0})
    assert status == 400 and "rank_offset: 0" in reply["message"]
    status, reply = _post(own_url + "/destroy_weights_update_group", {"group_name": "g"})
    assert status == 400 and "no such update group" in reply["message"]
    assert _post(own_url + "/begin_weight_update", {})[0] == 200
    try:
        status, reply = _post(own_url + "/update_weights_from_distributed", body)
        assert status == 400 and "/init_weights_update_group first" in reply["message"]
        wrong_shape = {**body, "shapes": [[3]]}
        status, reply = _post(own_url + "/update_weights_from_distributed", wrong_shape)
        assert status == 400 and "shape (3,) != model's" in reply["message"], reply
        wrong_dtype = {**body, "dtypes": ["float99"]}
        status, reply = _post(own_url + "/update_weights_from_distributed", wrong_dtype)
        assert status == 400 and "dtype 'float99'" in reply["message"]
        unknown = {**body, "names": ["model.no_such.weight"]}
        status, reply = _post(own_url + "/update_weights_from_distributed", unknown)
        assert status == 400 and "no such weight" in reply["message"]
        status, reply = _post(own_url + "/update_weights_from_distributed", {**body, "x": 1})
        assert status == 400 and "x: unknown field" in reply["message"]
    finally:
        assert _post(own_url + "/end_weight_update", {})[0] == 200
