"""Behaviour log-probs of constrained calls, where the engine reports them masked (SGLang).

The trainer's importance ratio needs, for every sampled token, the model's own log-prob l_t
(`gyre.rollout.sampling.policy_logprobs`). For a constrained call (the proxy's forced tool
calls: tool_choice required or a named tool, sent with an `ebnf` grammar) SGLang reports
instead the log-prob over the grammar-masked distribution, b_t = l_t - log Z_t, Z_t being
the model's mass on the tokens the grammar allows (docs/engine.md "Behaviour log-probs").

Where the proxy's engines do that (`Config.constrained_logprobs: masked`; a run sets it for
`engine.backend: sglang`), `rescore` asks the engine that served the call for the model's
own log-probs of its output: one prefill of context + output (`EngineClient.score`; the
context is in the engine's prefix cache, so it costs about one prefill of the output). They
replace the reported ones when computed at the weight version that sampled the call. When
they are not — a publication landed between the call and its rescore (the sampling weights
are gone, so a retry cannot help), or the prefill failed or was aborted — the masked values
are kept, a warning is logged and the outcome is counted (`gyre_proxy_rescores` in /metrics):
such a call's ratio keeps the log Z_t bias the correction removes from all the others.

    fixed = await rescore(engine, context_ids, result, rid)
    fixed.outcome    # "rescored" | "version_changed" | "failed"
    fixed.logprobs   # one per output token: the model's own, or the reported ones
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from gyre.errors import EngineError, ProtocolError
from gyre.proxy.routing import EngineLike
from gyre.rollout.protocol import GenerateResult

log = logging.getLogger(__name__)
RESCORED, VERSION_CHANGED, FAILED = "rescored", "version_changed", "failed"
OUTCOMES = (RESCORED, VERSION_CHANGED, FAILED)


@dataclass(frozen=True, slots=True)
class Rescored:
    """The behaviour log-probs to record for a constrained call, and how they were found."""

    outcome: str
    # RESCORED: the model's own, from the prefill; otherwise the engine's reported ones
    logprobs: list[float]


async def rescore(
    engine: EngineLike, context_ids: np.ndarray, result: GenerateResult, rid: str
) -> Rescored:
    """The model's own log-probs of `result`'s output after `context_ids`, computed by
    `engine` (the one that generated it) at `result.weight_version`; else the reported ones."""
    ids = np.concatenate([np.asarray(context_ids), np.asarray(result.output_ids, np.int64)])
    try:
        scored = await engine.score(ids, len(context_ids), f"{rid}-score")
    except (EngineError, ProtocolError, OSError) as e:
        log.warning("call %s: rescoring its constrained output failed (%s); its behaviour "
                    "log-probs stay the engine's grammar-masked ones", rid, e)  # fmt: skip
        return Rescored(FAILED, list(result.output_logprobs))
    if scored.weight_version != result.weight_version:
        log.warning("call %s: sampled at weight_version %r, rescored at %r; its behaviour "
                    "log-probs stay the engine's grammar-masked ones", rid,
                    result.weight_version, scored.weight_version)  # fmt: skip
        return Rescored(VERSION_CHANGED, list(result.output_logprobs))
    return Rescored(RESCORED, scored.logprobs)
