"""Gyre's harness-facing proxy: OpenAI (Chat Completions, Responses) and Anthropic APIs,
per-execution keys, TITO recording.

Black-box harnesses (Claude Code, Codex, mini-swe-agent, ...) talk to the proxy as if it
were a model API. The proxy renders each request to tokens with the model's chat template,
reusing the exact tokens recorded for earlier turns (TITO), routes it to a rollout engine
(rerouting calls aborted by a role switch), and records every call as a node of the
execution's trajectory tree. See docs/proxy.md.
"""

from typing import TYPE_CHECKING, Any

from gyre.proxy.config import Config as ProxyConfig
from gyre.proxy.config import RoleRule

if TYPE_CHECKING:
    from gyre.proxy.app import ProxyApp

__all__ = ["ProxyApp", "ProxyConfig", "RoleRule"]


def __getattr__(name: str) -> Any:
    """`ProxyApp` (Tornado, transformers) loads on first use: configs import this package."""
    if name == "ProxyApp":
        from gyre.proxy.app import ProxyApp

        return ProxyApp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
