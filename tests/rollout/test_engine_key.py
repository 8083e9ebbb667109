"""The engine key: an engine started with one answers 401 to every route but /health unless
the request carries it, and every client Gyre runs (the async `EngineClient`, the cell's
blocking calls through it) sends this process's key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from gyre.rollout.client import EngineClient, blocking
from gyre.rollout.protocol import ENGINE_KEY_ENV, SamplingParams
from gyre.rollout.testing import running_engine

from .conftest import run

KEY = "k3y-of-this-run"


def _status(url: str, body: object | None, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_an_engine_with_a_key_serves_only_callers_that_hold_it(
    monkeypatch: pytest.MonkeyPatch, prompt: list[int]
) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    generate = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
    with running_engine("tiny", max_batch_size=4, api_key=KEY) as url:
        for route, body in [("/model_info", None), ("/generate", generate),
                            ("/update_weights_from_tensor", {}), ("/release_memory_occupation", {}),
                            ("/gyre/stats", None), ("/gyre/kv/segments/00ff", None)]:  # fmt: skip
            assert _status(url + route, body, None) == 401, route
            assert _status(url + route, body, "Bearer-not-it") == 401, route
        assert _status(url + "/health", None, None) == 200  # probes stay open, as in SGLang
        assert _status(url + "/model_info", None, KEY) == 200
        assert _status(url + "/generate", generate, KEY) == 200

        sampling = SamplingParams(max_new_tokens=3, ignore_eos=True)
        with pytest.raises(Exception, match="401"):  # no key in this process: refused
            run(EngineClient(url).generate(prompt, sampling, "no-key"))
        assert (
            len(run(EngineClient(url, api_key=KEY).generate(prompt, sampling, "r1")).output_ids)
            == 3
        )
        monkeypatch.setenv(ENGINE_KEY_ENV, KEY)  # what a run's ranks have
        assert len(run(EngineClient(url).generate(prompt, sampling, "r2")).output_ids) == 3
        assert blocking(url, EngineClient.weight_version) == "0"  # the cell's blocking calls


def test_the_cuda_engine_takes_the_key_like_the_cpu_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m gyre.gpu.engine` (what a cell launches on a GPU) builds its server config
    with the CPU engine's function, so it requires the run's key too (it used to serve
    every caller). Its serve is replaced here: only the config it would serve is checked."""
    from gyre.gpu import engine as cuda_engine

    seen = []

    async def serve(config, placement):  # type: ignore[no-untyped-def]
        seen.append((config, placement))

    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    monkeypatch.setattr(cuda_engine, "serve", serve)
    assert cuda_engine.main(["--device", "cpu", "--model", "tiny", "--port", "0"]) == 0
    ((config, placement),) = seen
    assert config.api_key == KEY and config.port == 0 and config.engine.model == "tiny"
    assert placement.device == "cpu"  # its own flag, not passed on to gyre engine's parser
