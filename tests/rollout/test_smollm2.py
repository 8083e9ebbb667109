"""SmolLM2-135M-Instruct, published as a run publishes it, is a plain Hugging Face model that
the embedded engine serves, and answers a real question."""

from __future__ import annotations

import json

import pytest
import torch

from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import SamplingParams

from .conftest import run

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


def test_smollm2_knows_the_capital_of_france(smollm2_url: str) -> None:
    from gyre.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    client = EngineClient(smollm2_url)
    info = run(client.model_info())
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    res = run(client.generate(ids, SamplingParams(max_new_tokens=24, temperature=0), "paris"))
    assert info["vocab_size"] == 49152
    assert "Paris" in res.text, res.text
    assert res.finish_type in ("stop", "length")


def test_a_published_smollm2_policy_is_a_plain_loadable_model(smollm2_policy, smollm2_url) -> None:
    """The runtime's publication of SmolLM2 (loaded from GGUF): transformers loads the
    directory, with no quantization mark left, and computes the logits the run's model had;
    `gyre engine --model DIR` serves it (every SmolLM2 test talks to that engine)."""
    from transformers import AutoModelForCausalLM

    path, prompt, logits = smollm2_policy
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        got = model(torch.tensor([prompt])).logits
    assert torch.allclose(got, logits, atol=1e-5)
    assert run(EngineClient(smollm2_url).model_info())["model_path"] == str(path)
