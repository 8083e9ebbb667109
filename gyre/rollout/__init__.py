"""Rollout: Gyre's embedded CPU inference engine and the client that drives any engine.

The engine (`gyre.rollout.server`, `gyre.rollout.engine`) serves the subset of SGLang's
native HTTP protocol that Gyre uses over a transformers causal LM; `gyre.rollout.client.
EngineClient` speaks that protocol and works unchanged against real SGLang on GPUs.
`gyre.rollout.protocol` holds the request/response shapes (no torch import), so the proxy
can use the client without loading torch. See docs/engine.md.
"""
