"""SmolLM2-135M-Instruct served by the embedded engine answers a real question."""

from __future__ import annotations

import pytest

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
