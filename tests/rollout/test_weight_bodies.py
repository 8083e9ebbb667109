"""No weight bytes in JSON bodies: every movement a cell makes to a real embedded engine,
watched on the wire.

A recording forwarder on the loopback (`gyre.rollout.testing.recording_forwarder`) sits
between the cell's code and a real engine process: it keeps each request's route and body
size and passes the request on unchanged.
The cell's own functions then move a model larger than the body limit every way a run does —
a publication (`publication.publish`, `engine.publication` auto: the engine is on this
node, so by handle), a reload / respawn / resume (`EngineHost.load_weights`), and a
publication to an engine on another node (the same engine, reached at an address that is not
the rank's own: through an update group) — and the engine must serve the moved weights.
Before buckets by handle, each of these posted the whole model as base64 in one body.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams
from gyre.rollout.testing import recording_forwarder, running_engine
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.cell.publication import publish
from gyre.runtime.shared.config import EngineConfig

from .conftest import run

BODY_LIMIT = 64 << 10  # a body above this carries weights (the tiny model is 1.3 MB)
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def watched() -> Iterator[tuple[str, str, list[tuple[str, str, int]]]]:
    """(the forwarder's url, the engine's own url, what the forwarder saw)."""
    with running_engine("tiny") as url, recording_forwarder(url) as (forward, seen):
        yield forward, url, seen


def _perturbed(model: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=gen))
            for n, p in model.named_parameters()]  # fmt: skip


def _heavy(seen: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    return [s for s in seen if s[2] > BODY_LIMIT]


def test_no_movement_puts_weights_in_a_json_body(watched, tiny, prompt, tmp_path: Path) -> None:
    url, engine_url, seen = watched
    model, _ = tiny
    named = _perturbed(model, 3)
    assert sum(t.numel() * t.element_size() for _, t in named) > 10 * BODY_LIMIT
    config = EngineConfig(distributed_above_mb=0.5)  # the tiny model counts as large

    # a publication from the core to an engine on its node
    assert publish([(0, url)], named, 1, config, host="127.0.0.1") == []
    served = run(EngineClient(engine_url).generate(prompt, GREEDY, "published"))
    assert served.weight_version == "1"
    # a reload, respawn or resume: the cell's own engine, through its host
    host = EngineHost("tiny", config, tmp_path / "engine.log", version=1)
    host.url = url
    host.load_weights(_perturbed(model, 4), 2)
    reloaded = run(EngineClient(engine_url).generate(prompt, GREEDY, "reloaded"))
    assert reloaded.weight_version == "2" and reloaded.output_ids != served.output_ids
    # a publication to an engine on another node (its address is not the rank's own)
    assert publish([(0, url)], named, 3, config, host="127.0.0.2") == []
    again = run(EngineClient(engine_url).generate(prompt, GREEDY, "from-afar"))
    assert again.weight_version == "3" and again.output_ids == served.output_ids
    assert again.output_logprobs == served.output_logprobs  # the same weights, exactly

    routes = {route for _, route, _ in seen}
    assert {"/update_weights_from_tensor", "/update_weights_from_distributed"} <= routes
    assert _heavy(seen) == [], _heavy(seen)
    assert max(n for *_, n in seen) < 4 << 10  # a handle, metadata and specs: a few KB


def test_http_publication_still_carries_the_weights_by_value(watched, tiny) -> None:
    """The check above sees weights where they are: `engine.publication: http` (small models,
    measurements) posts them by value, in buckets of `engine.bucket_mb`."""
    url, _, seen = watched
    before = len(seen)
    named = _perturbed(tiny[0], 5)
    assert publish([(0, url)], named, 4, EngineConfig(publication="http", bucket_mb=1),
                   host="127.0.0.1") == []  # fmt: skip
    heavy = _heavy(seen[before:])
    assert [r for _, r, _ in heavy] == ["/update_weights_from_tensor"] * 2  # 1.3 MB: 2 buckets
    assert all(n < (1 << 20) * 1.4 + 4096 for *_, n in heavy)  # base64 of at most 1 MiB each
