"""Fixtures for the proxy tests: one embedded tiny engine per session, proxies per test.

The engine is a real subprocess (`gyre.rollout.testing.running_engine`); each proxy is a
real Tornado server on its own IOLoop thread (`gyre.proxy.testing.running_proxy`).
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gyre.config import load
from gyre.models import tiny_tokenizer
from gyre.proxy.config import Config
from gyre.proxy.testing import RunningProxy, running_proxy
from gyre.rollout.testing import running_engine
from gyre.runtime.shared.config import RunConfig
from gyre.trajectory.tree import TrajectoryTree, node_to_dict

MODEL = "gyre-tiny"


def function_tool(name: str, description: str, **types: str) -> dict[str, Any]:
    """An OpenAI function tool whose parameters are all required, of the JSON `types` given."""
    properties = {key: {"type": kind} for key, kind in types.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(types)},
        },
    }


LS_TOOL = function_tool("ls", "List the files in a directory.", path="string", all="boolean")
READ_TOOL = function_tool("read", "Read a file.", file="string", limit="integer")
TOOLS = [LS_TOOL, READ_TOOL]


def harness_run_config(adapter: str, max_context_tokens: int) -> RunConfig:
    """A run's config for the harness `adapter`, serving MODEL with this context limit."""
    return load(
        RunConfig,
        {"model_name": MODEL, "harness": {"adapter": adapter},
         "proxy": {"model_names": [MODEL], "max_context_tokens": max_context_tokens}},
        path="run",
    )  # fmt: skip


def anthropic_tools() -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    with running_engine("tiny") as url:
        yield url


@pytest.fixture
def proxy(engine_url: str, tokenizer: Any) -> Iterator[RunningProxy]:
    config = Config(model_names=[MODEL], max_body_bytes=256 * 1024, reroute_wait_s=5.0)
    with running_proxy({"e0": engine_url}, tokenizer=tokenizer, config=config) as p:
        yield p


def engine_requests(url: str) -> dict[str, list[int]]:
    """rid -> input_ids the engine received (its own log)."""
    with urllib.request.urlopen(url + "/gyre/requests", timeout=30) as r:
        log = json.load(r)["requests"]
    return {e["rid"]: e["input_ids"] for e in log}


def assert_paths_match_engine(p: RunningProxy, execution_id: str, url: str) -> int:
    """Every node's path tokens == what the engine received for that call (last attempt)."""
    return assert_paths_match(p, execution_id, engine_requests(url))


def assert_paths_match(p: RunningProxy, execution_id: str, received: dict[str, list[int]]) -> int:
    """Every node's path tokens == the input ids of its call in `received` (rid -> ids)."""
    tree = p.call(p.app.tree, execution_id)
    for node in tree.nodes:
        prefix = f"{execution_id}-{node.node_id}-"
        rids = [r for r in received if r.startswith(prefix) and r.endswith(f"-{node.attempts}")]
        assert len(rids) == 1, (node.node_id, rids)
        context = p.call(tree.context_ids, node.node_id)
        assert np.array_equal(context, np.asarray(received[rids[0]], np.int32)), node.node_id
    return len(tree.nodes)


def tree_digest(tree: TrajectoryTree, nodes: int | None = None) -> str:
    """blake2b over every field of the tree's first `nodes` nodes (all by default)."""
    h = hashlib.blake2b(tree.execution_id.encode(), digest_size=16)
    for node in tree.nodes[:nodes]:
        h.update(json.dumps(node_to_dict(node), sort_keys=True).encode())
    return h.hexdigest()
