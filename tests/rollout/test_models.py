"""gyre.models: the tiny model is identical in every process; the shipped chat template
renders tools, tool calls and tool results in the documented layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gyre.errors import ConfigError
from gyre.models import load_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tiny_model_shape(tiny: Any) -> None:
    # Identical weights across processes are shown by the engine tests: the engine
    # subprocess's log-probs equal this process's plain forward pass.
    model, tok = tiny
    assert model.config.vocab_size == len(tok) == 4096 and model.dtype == torch.float32
    assert model.config.tie_word_embeddings


def test_chat_template_renders_tools_calls_and_grouped_results(tiny: Any) -> None:
    _, tok = tiny
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]  # fmt: skip
    text = tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert text.count("<|im_start|>system") == 1
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE is lossless
    assert tok.convert_tokens_to_ids("<tool_call>") in ids


def test_plain_chat_without_tools(tiny: Any) -> None:
    _, tok = tiny
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        tokenize=False,
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert tok.eos_token == "<|im_end|>"


def test_unknown_model_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="allowed: tiny, tiny:HIDDENxLAYERS, smollm2-135m"):
        load_model("no-such-model")


def test_tiny_family_sizes_and_their_errors() -> None:
    model, tok = load_model("tiny:32x1")
    again, _ = load_model("tiny:32x1")
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    for bad in ("tiny:", "tiny:64", "tiny:60x2", "tiny:64x0", "tiny:axb"):
        with pytest.raises(ConfigError, match=r"tiny:HIDDENxLAYERS|multiple of 8"):
            load_model(bad)
