"""Weight updates and memory release on the embedded engine (each test owns its engine)."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gyre.errors import EngineError
from gyre.rollout.buckets import FlatBucket
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams, release_procedure, resume_procedure
from gyre.rollout.testing import running_engine
from gyre.rollout.weights import serialize_bucket

from .conftest import post_json as _post
from .conftest import run
from .reference import reference_logits, slow_distribution

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def own_url() -> Iterator[str]:
    """An engine these tests may change (weights, memory state)."""
    with running_engine("tiny") as url:
        yield url


def test_update_weights_changes_outputs_and_version(
    own_url: str, prompt: list[int], tiny: Any
) -> None:
    model, _ = tiny
    gen = torch.Generator().manual_seed(5)
    names = ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight")
    params = model.state_dict(keep_vars=True)
    original = [(n, params[n].detach().clone()) for n in names]
    named = [(n, t + 0.5 * torch.randn(t.shape, generator=gen)) for n, t in original]

    async def scenario() -> tuple[Any, Any, str, Any]:
        client = EngineClient(own_url)
        before = await client.generate(prompt, GREEDY, "before")
        long = SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)
        inflight = asyncio.ensure_future(client.generate(prompt, long, "across-update"))
        while (await client.stats())["running"] == 0:
            await asyncio.sleep(0.01)
        await client.pause("in_place")  # hold it mid-call, so it is surely in flight
        await client.update_weights_from_tensor(named, version="7")  # paused in mode retract
        after = await client.generate(prompt, GREEDY, "after")
        return before, after, await client.weight_version(), await inflight

    before, after, version, across = run(scenario())
    # the call in flight was retracted, not aborted: it ends normally, on the new weights
    assert (across.finish_type, len(across.output_ids)) == ("length", 300)
    assert across.weight_version == "7"
    bad = [("model.no_such.weight", torch.zeros(2))]
    with pytest.raises(EngineError, match="no such weight"):
        run(EngineClient(own_url).update_weights_from_tensor(bad, version="8"))
    wrong_shape = [("model.norm.weight", torch.zeros(3))]
    with pytest.raises(EngineError, match="shape"):
        run(EngineClient(own_url).update_weights_from_tensor(wrong_shape, version="8"))
    status, reply = _post(
        own_url + "/update_weights_from_tensor", {"serialized_named_tensors": ["%%"]}
    )
    assert status == 400 and "base64" in reply["message"]
    unchanged = run(EngineClient(own_url).generate(prompt, GREEDY, "unchanged"))

    assert before.weight_version == "0" and after.weight_version == "7" and version == "7"
    assert after.output_ids != before.output_ids
    assert unchanged.output_ids == after.output_ids and unchanged.weight_version == "7"
    # The engine now computes with exactly the loaded weights.
    _copy_into(model, named)
    try:
        for k, row in enumerate(reference_logits(model, prompt, after.output_ids)):
            expected = slow_distribution(row, 0.0, 1.0)[after.output_ids[k]]
            assert after.output_logprobs[k] == pytest.approx(expected, abs=1e-4)
    finally:
        _copy_into(model, original)


def _copy_into(model: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in named:
            params[name].copy_(t)


def test_weight_updates_need_a_session_and_a_clean_payload(own_url: str, tiny: Any) -> None:
    """SGLang's rules, served the same way: updates only inside /begin_weight_update …
    /end_weight_update (409 otherwise), load_format null or flattened_bucket, and a payload
    that is a pickle of tensors and nothing else (no other globals are loaded)."""
    norm = tiny[0].get_parameter("model.norm.weight").detach()
    bucket = FlatBucket.pack([("model.norm.weight", norm)])
    good = {"serialized_named_tensors": [serialize_bucket(bucket, by_handle=False)],
            "load_format": "flattened_bucket"}  # fmt: skip
    status, reply = _post(own_url + "/update_weights_from_tensor", good)
    assert status == 409 and "/begin_weight_update" in reply["message"]
    assert _post(own_url + "/end_weight_update", {})[0] == 409
    assert _post(own_url + "/begin_weight_update", {})[0] == 200
    try:
        status, reply = _post(own_url + "/begin_weight_update", {})
        assert status == 409 and "already open" in reply["message"]
        status, reply = _post(
            own_url + "/update_weights_from_tensor", {**good, "load_format": "torch_save"}
        )
        assert status == 400 and "load_format: 'torch_save'" in reply["message"]
        evil = base64.b64encode(pickle.dumps([("x", os.getpid)])).decode()
        status, reply = _post(
            own_url + "/update_weights_from_tensor", {"serialized_named_tensors": [evil]}
        )
        assert status == 400 and "posix.getpid is not allowed" in reply["message"]
        status, reply = _post(own_url + "/update_weights_from_tensor", good)
        assert status == 200 and reply["success"] is True
    finally:
        assert _post(own_url + "/end_weight_update", {})[0] == 200


def test_release_needs_an_idle_engine_and_resume_restores(own_url: str, prompt: list[int]) -> None:
    """A bare release while a call runs is refused (SGLang asserts it is idle); the role
    switch pauses in mode "abort" first, and resume + continue bring the same weights back."""
    long = SamplingParams(max_new_tokens=5000, temperature=1.0, ignore_eos=True)

    async def scenario() -> tuple[Any, Any, Any, dict[str, Any]]:
        client = EngineClient(own_url)
        before = await client.generate(prompt, GREEDY, "before")
        inflight = asyncio.ensure_future(client.generate(prompt, long, "inflight"))
        await asyncio.sleep(0.3)
        with pytest.raises(EngineError, match=r"HTTP 409: .*1 calls in flight.*pause_generation"):
            await client.release_memory()
        assert not inflight.done() and (await client.stats())["running"] == 1
        await client.run(release_procedure())
        aborted = await inflight
        stats = await client.stats()
        with pytest.raises(EngineError, match=r"HTTP 503.*released"):
            await client.generate(prompt, GREEDY, "while-released")
        assert await client.health()
        await client.run(resume_procedure())
        after = await client.generate(prompt, GREEDY, "after")
        return before, aborted, after, stats

    before, aborted, after, stats = run(scenario())
    assert aborted.finish_type == "abort" and "pause_generation" in aborted.message
    assert stats["released"] and stats["paused"] and stats["running"] == 0
    assert after.output_ids == before.output_ids
    assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-4)


class _TcpTicket:
    """Pickles as a shared storage whose descriptor ticket names a TCP address."""

    def __reduce__(self) -> Any:
        from multiprocessing import resource_sharer

        from torch.multiprocessing import reductions

        ticket = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
        ticket._id = (("127.0.0.1", 9), 1)
        return (reductions.rebuild_storage_fd, (torch.UntypedStorage, ticket, 16))


def _handle_body(payload: dict[str, Any]) -> dict[str, Any]:
    import io
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(payload)
    return {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()],
            "load_format": "flattened_bucket"}  # fmt: skip


def test_a_bucket_by_handle_loads_only_from_this_runs_publisher(own_url: str, tiny: Any) -> None:
    """A bucket by handle (CPU shared memory through torch's reductions) loads; a handle
    from a process without the run's key, a ticket naming a TCP address, or records that do
    not tile the buffer are refused with 400 and a message, and nothing is loaded."""
    import multiprocessing

    from gyre.rollout.weights import share_key

    norm = tiny[0].get_parameter("model.norm.weight").detach()
    bucket = FlatBucket.pack([("model.norm.weight", norm * 2)], shared=True)
    meta = bucket.wire_metadata()
    assert _post(own_url + "/begin_weight_update", {})[0] == 200
    try:
        good = {"serialized_named_tensors": [serialize_bucket(bucket, by_handle=True)],
                "load_format": "flattened_bucket", "weight_version": "h1"}  # fmt: skip
        assert len(good["serialized_named_tensors"][0]) < 2000  # a handle, not 4 KB of weights
        status, reply = _post(own_url + "/update_weights_from_tensor", good)
        assert status == 200, reply
        from multiprocessing import resource_sharer

        resource_sharer.stop()
        multiprocessing.current_process().authkey = b"another run" * 3
        try:
            foreign = _handle_body({"flattened_tensor": bucket.flat, "metadata": meta})
        finally:
            share_key()
        status, reply = _post(own_url + "/update_weights_from_tensor", foreign)
        assert status == 400 and "not a pickle of a flattened bucket" in reply["message"], reply
        tcp = _handle_body({"flattened_tensor": _TcpTicket(), "metadata": meta})
        status, reply = _post(own_url + "/update_weights_from_tensor", tcp)
        assert status == 400 and "Unix socket" in reply["message"], reply
        meta[0].end_idx += 4  # a record past the buffer's end
        bad = _handle_body({"flattened_tensor": bucket.flat, "metadata": meta})
        status, reply = _post(own_url + "/update_weights_from_tensor", bad)
        assert status == 400 and "metadata" in reply["message"], reply
    finally:
        assert _post(own_url + "/end_weight_update", {})[0] == 200
    assert run(EngineClient(own_url).weight_version()) == "h1"
