"""Forced tool calls on engines that report grammar-masked log-probs are rescored.

SGLang reports a constrained call's log-probs over the grammar-masked distribution
(b_t = l_t - log Z_t); the embedded engine reproduces that with
`--logprobs-under-grammar masked`. With `constrained_logprobs: masked` the proxy rescores
each forced call's output with one prefill at the same weight version and records the
model's own log-probs l_t — the ones the trainer recomputes (`target_logprobs`), so a
fresh call's importance ratio is 1. Without the rescore the recorded values are b_t
(>= l_t, measurably apart). A rescore at another weight version, or a failed one, keeps the
reported values and is counted by outcome (/metrics `gyre_proxy_rescores`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from conftest import MODEL, TOOLS
from prometheus_client.parser import text_string_to_metric_families

from gyre.errors import EngineError
from gyre.models import load_model
from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, ScriptedEngine, running_proxy
from gyre.rollout.protocol import ScoreResult
from gyre.rollout.testing import running_engine
from gyre.runtime.proxy_node.node import proxy_config
from gyre.runtime.shared.config import EngineConfig, load_run_config
from gyre.train.objective import target_logprobs

HERMES_CALL = '<tool_call>\n{"name": "ls", "arguments": {"path": "a", "all": true}}\n</tool_call>'


@pytest.fixture(scope="module")
def masked_engine_url() -> Iterator[str]:
    """An embedded engine reporting constrained calls' log-probs as SGLang does."""
    with running_engine("tiny", extra_args=("--logprobs-under-grammar", "masked")) as url:
        yield url


def forced_call(p: RunningProxy, execution_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One tool_choice "required" call; (context ids, output ids, recorded log-probs)."""
    key = p.call(p.app.register_execution, execution_id, "main")
    client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "list the files"}],
        tools=TOOLS, tool_choice="required", max_tokens=200,
    )  # fmt: skip
    assert reply.choices[0].message.tool_calls, reply
    tree = p.call(p.app.tree, execution_id)
    (node,) = tree.nodes
    return p.call(tree.context_ids, node.node_id), node.output_ids, node.output_logprobs


def model_logprobs(context: np.ndarray, output: np.ndarray) -> np.ndarray:
    """The trainer's log-probs of `output` after `context` (float64, one plain forward)."""
    model, _ = load_model("tiny")
    ids = torch.as_tensor(np.concatenate([context, output]), dtype=torch.long)[None]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.double()
    return target_logprobs(logits, ids)[0, len(context) :].numpy()


def rescores(p: RunningProxy) -> dict[str, float]:
    """gyre_proxy_rescores_total by outcome, as /metrics reports it."""
    text, _ = p.call(p.app.metrics.exposition, p.app.service, None)
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "gyre_proxy_rescores_total"
    }


def test_forced_call_records_the_models_own_logprobs(
    masked_engine_url: str, tokenizer: Any
) -> None:
    seeded = Config(model_names=[MODEL], max_tokens_cap=200, sampling_seed=11)
    config = dataclasses.replace(seeded, constrained_logprobs="masked")
    with running_proxy({"e0": masked_engine_url}, tokenizer=tokenizer, config=config) as p:
        context, output, recorded = forced_call(p, "forced")
        assert rescores(p) == {"rescored": 1.0, "version_changed": 0.0, "failed": 0.0}
    own = model_logprobs(context, output)
    assert np.abs(recorded - own).max() < 2e-6  # float32 storage of the float64 values

    # The same call (same seed, same tokens) recorded as the engine reports it: b_t >= l_t.
    config = dataclasses.replace(seeded, constrained_logprobs="model")
    with running_proxy({"e0": masked_engine_url}, tokenizer=tokenizer, config=config) as p:
        context2, output2, masked = forced_call(p, "forced")
        assert rescores(p) == {"rescored": 0.0, "version_changed": 0.0, "failed": 0.0}
    assert np.array_equal(context2, context) and np.array_equal(output2, output)
    assert (masked >= own - 2e-6).all()
    assert (masked - own).max() > 0.1  # log Z_t of the steps where the grammar cut mass


class RepublishedEngine(ScriptedEngine):
    """Serves weight version 0, but a publication lands before the rescore."""

    async def score(self, input_ids: Any, start: int, rid: str) -> ScoreResult:
        return ScoreResult(logprobs=[-0.5] * (len(input_ids) - start), weight_version="1")


class FailingScoreEngine(ScriptedEngine):
    async def score(self, input_ids: Any, start: int, rid: str) -> ScoreResult:
        raise EngineError("engine e0 /generate: HTTP 503: memory released")


@pytest.mark.parametrize(
    ("engine_type", "outcome"),
    [(ScriptedEngine, "rescored"), (RepublishedEngine, "version_changed"),
     (FailingScoreEngine, "failed")],
)  # fmt: skip
def test_a_rescore_at_another_version_or_failed_keeps_the_reported_logprobs(
    engine_type: type[ScriptedEngine], outcome: str, tokenizer: Any
) -> None:
    engine = engine_type(tokenizer, [HERMES_CALL])
    config = Config(model_names=[MODEL], constrained_logprobs="masked")
    with running_proxy({"e0": engine}, tokenizer=tokenizer, config=config) as p:
        _, output, recorded = forced_call(p, f"forced-{outcome}")
        counts = rescores(p)
    assert counts[outcome] == 1.0 and sum(counts.values()) == 1.0
    assert recorded.tolist() == [-1.0] * len(output)  # the scripted (reported) log-probs


def test_unforced_calls_are_not_rescored(tokenizer: Any) -> None:
    engine = RepublishedEngine(tokenizer, ["Plain text."])
    config = Config(model_names=[MODEL], constrained_logprobs="masked")
    with running_proxy({"e0": engine}, tokenizer=tokenizer, config=config) as p:
        key = p.call(p.app.register_execution, "auto", "main")
        client = openai.OpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS
        )
        assert sum(rescores(p).values()) == 0.0
        assert json.dumps(p.app.service.rescores) == "{}"


def test_a_run_on_sglang_engines_rescores_forced_calls() -> None:
    """The proxy node's config: engine.backend sglang -> constrained_logprobs masked."""
    root = Path(__file__).resolve().parents[2]
    cfg = load_run_config(root / "templates" / "local.yaml")
    assert proxy_config(cfg).constrained_logprobs == "model"
    sglang = dataclasses.replace(cfg, engine=EngineConfig(backend="sglang"))
    assert proxy_config(sglang).constrained_logprobs == "masked"
