"""Gyre's harness-facing proxy: OpenAI / Anthropic APIs, per-execution keys, TITO recording.

Black-box harnesses (Claude Code, Codex, mini-swe-agent, ...) talk to the proxy as if it
were a model API. The proxy renders each request to tokens with the model's chat template,
reusing the exact tokens recorded for earlier turns (TITO), routes it to a rollout engine
(rerouting calls aborted by a role switch), and records every call as a node of the
execution's trajectory tree. See docs/proxy.md.
"""

from gyre.proxy.app import ProxyApp
from gyre.proxy.config import Config as ProxyConfig
from gyre.proxy.config import RoleRule

__all__ = ["ProxyApp", "ProxyConfig", "RoleRule"]
