"""Configuration of the harness-facing proxy (`gyre proxy`, or the proxy node of a run).

Loaded from the `proxy:` section of a run's YAML with `gyre.config.load(Config, data)`;
every field is validated in `__post_init__` and a bad value names the field and what is
allowed. Role rules (`gyre.vocabulary.RoleRule`, shared with the harness adapters, which ship
rules per harness) label calls that carry no `x-gyre-role` header (first match wins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gyre.errors import ConfigError
from gyre.vocabulary import ROLE_RE, RoleRule

__all__ = ["ROLE_RE", "Config", "RoleRule"]


@dataclass(kw_only=True, slots=True)
class Config:
    """Harness-facing proxy: served names, limits, sampling defaults, rerouting, role rules."""

    model_names: list[str] = field(default_factory=lambda: ["gyre"])
    # model names the proxy accepts (first is listed first in /v1/models); others get 404
    max_body_bytes: int = 32 * 1024 * 1024
    # request bodies larger than this get 413
    max_tokens_cap: int = 4096
    # a request's max_tokens is capped to this
    default_max_tokens: int = 1024
    # OpenAI requests without max_tokens / max_completion_tokens generate at most this many
    max_context_tokens: int = 32768
    # prompt + output must fit; a longer prompt gets 400, max_tokens is cut to what fits
    default_temperature: float = 1.0
    # temperature when the request gives none (1.0 keeps behaviour log-probs on-policy)
    sampling_seed: int | None = None
    # base of every call's sampling seed (hash of it, the execution id and the call's index):
    # a call is repeatable; None: engines draw fresh seeds. `gyre run` sets it to train.seed
    reroute_attempts: int = 8
    # engine attempts per call (aborts by a role switch, engine errors) before 503/529
    reroute_wait_s: float = 30.0
    # how long an aborted call waits for the coordinator to give its execution a new engine
    engine_timeout_s: float = 3600.0
    # per-attempt HTTP timeout towards an engine
    default_role: str = "main"
    # role label of executions registered without one
    role_rules: list[RoleRule] = field(default_factory=list)
    # labels for calls without an x-gyre-role header; no match -> the execution's role
    render_threads: int = 4
    # worker threads that render + tokenize new input (the tokenizer releases the GIL)
    tool_string_max: int = 32
    # longest string value a forced tool call (tool_choice required/named) may generate
    tool_format: Literal["auto", "hermes", "qwen3_coder", "llama3_json"] = "auto"
    # how the model writes tool calls; auto: from its chat template (gyre.models.tool_format)
    constrained_logprobs: Literal["model", "masked"] = "model"
    # what the engines report as log-probs of constrained (forced tool) calls: the model's
    # own (model: the embedded engine) or over the grammar-masked distribution (masked:
    # SGLang; a run sets it for engine.backend sglang). masked: the proxy rescores each
    # forced call's output with one prefill and records those (gyre.proxy.rescore)

    def __post_init__(self) -> None:
        if not self.model_names or not all(isinstance(m, str) and m for m in self.model_names):
            raise ConfigError(f"model_names: {self.model_names!r}; allowed: non-empty names")
        for name in ("max_body_bytes", "max_tokens_cap", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)}; allowed: an integer >= 1")
        if self.max_context_tokens < 2:
            raise ConfigError(f"max_context_tokens: {self.max_context_tokens}; allowed: >= 2")
        if not 0 <= self.default_temperature <= 2:
            raise ConfigError(f"default_temperature: {self.default_temperature}; allowed: 0..2")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise ConfigError(f"sampling_seed: {self.sampling_seed}; allowed: 0..2**63-1 or null")
        if self.reroute_attempts < 1:
            raise ConfigError(f"reroute_attempts: {self.reroute_attempts}; allowed: >= 1")
        if self.reroute_wait_s < 0 or self.engine_timeout_s <= 0:
            raise ConfigError("reroute_wait_s / engine_timeout_s: allowed: >= 0 / > 0 seconds")
        if not ROLE_RE.fullmatch(self.default_role):
            raise ConfigError(f"default_role: {self.default_role!r}; allowed: 1-64 of A-Za-z0-9_.-")
        if not 1 <= self.render_threads <= 256:
            raise ConfigError(f"render_threads: {self.render_threads}; allowed: 1..256")
        if self.tool_format not in ("auto", "hermes", "qwen3_coder", "llama3_json"):
            raise ConfigError(
                f"tool_format: {self.tool_format!r}; "
                "allowed: auto, hermes, qwen3_coder, llama3_json"
            )
        if self.constrained_logprobs not in ("model", "masked"):
            raise ConfigError(
                f"constrained_logprobs: {self.constrained_logprobs!r}; allowed: model, masked"
            )
        if not 1 <= self.tool_string_max <= 1024:
            raise ConfigError(f"tool_string_max: {self.tool_string_max}; allowed: 1..1024")
