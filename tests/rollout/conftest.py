"""Fixtures of the rollout tests: one shared tiny engine subprocess and the tiny model.

`engine_url` serves tests that do not change the engine's weights or memory state; tests
that do start their own engine with `running_engine`.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from gyre.rollout.testing import running_engine

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine on a fresh event loop (each test owns its loop)."""
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    with running_engine("tiny", max_batch_size=8) as url:
        yield url


@pytest.fixture(scope="session")
def tiny() -> Any:
    """The tiny model and tokenizer loaded in the test process (slow reference)."""
    from gyre.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def prompt(tiny: Any) -> list[int]:
    """A ChatML prompt in the tiny tokenizer."""
    _, tok = tiny
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def post_json(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST a JSON body straight to an engine route: (status, decoded reply), errors included."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
