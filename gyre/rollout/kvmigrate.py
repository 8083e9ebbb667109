"""KV-cache migration on reroute: the handoff a cell runs before it aborts its engine's calls.

When a cell leaves rollout, every execution routed to its engine is rerouted: the proxy
retries each aborted call, with the same input, at the execution's new engine, which would
prefill the whole context again (up to ~1M tokens per execution on a cluster). Paper §4.3
migrates the KV cache instead: the source pins the prefix blocks, the destination reads
them, the source releases them only after the destination acknowledged, and any failure
falls back to recomputing. Here, for each execution (a rid prefix, since the proxy names its
calls ``"{execution_id}-{node}-{hex}-{attempt}"``):

1. **pin** (source, ``POST /gyre/kv/pin``): at a step boundary the source copies the KV of
   the execution's running calls (their prompts) and of the prefix-cache entries its earlier
   calls left into pinned host buffers (`gyre.rollout.kvstore`);
2. **read + acknowledge** (destination, ``POST /gyre/kv/import``): the destination reads
   each buffer one-sidedly (Mooncake Transfer Engine, or HTTP GET), inserts it into its
   prefix cache, and replies with what it took over;
3. **release** (source, ``POST /gyre/kv/release``), always, once every destination replied
   (pins also expire after ``ttl_s``, and a memory release drops them).

The cell then aborts its engine's calls as before (``/abort_request`` with ``abort_all``);
each retried call finds its prompt in the destination's prefix cache (``cached_tokens`` in
its reply). The running calls keep decoding during the handoff (the pins are copies taken at
a step boundary, so nothing writes them), and a call that ends meanwhile is simply answered.
A failed migration changes nothing but speed: the destination recomputes.

    from gyre.rollout.kvmigrate import execution_prefix, migrate_kv
    results = migrate_kv(engine_url, {execution_prefix(eid): dest_url for eid, dest_url in routes})
    # {rid_prefix: Migration(outcome="migrated" | "partial" | "none" | "failed" | "unsupported", ...)}

`migrate_kv` blocks (for a cell rank, which has no event loop) and never raises for engine
failures; `migrate` is the same handoff as a coroutine. Real SGLang serves no such routes
(it has no API to export a running request's KV to another instance): against it the
outcome is "unsupported" and the destination recomputes (see docs/engine.md for SGLang's
HiCache L3 alternative). This module does not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass

from gyre.errors import EngineError
from gyre.rollout.client import EngineClient, blocking
from gyre.rollout.protocol import KVImportResult, KVSegment

OUTCOMES = ("migrated", "partial", "none", "failed", "unsupported")


@dataclass(frozen=True, slots=True)
class Migration:
    """What the handoff did for one execution (rid prefix)."""

    selector: str
    # the rid prefix (execution) it was asked for
    destination: str
    # the destination engine's URL
    outcome: str
    # "migrated" (every segment taken over), "partial", "none" (nothing cached for it),
    # "failed" (the destination recomputes), "unsupported" (the source has no KV routes)
    segments: int = 0
    # segments the destination took over
    tokens: int = 0
    # positions the destination took over (summed over segments)
    nbytes: int = 0
    transport: str = ""
    # "mooncake" | "http" (of the segments taken over)
    seconds: float = 0.0
    # the whole handoff: pin, read, acknowledgement, release
    error: str = ""


def execution_prefix(execution_id: str) -> str:
    """The rid prefix of an execution's calls (the proxy's rids are
    ``"{execution_id}-{node}-{hex}-{attempt}"``; the dash keeps ``g1-e1`` off ``g1-e10``)."""
    return f"{execution_id}-"


def migrate_kv(
    source_url: str,
    routes: Mapping[str, str],
    *,
    transport: str = "auto",
    ttl_s: float = 120.0,
    timeout: float = 60.0,
) -> dict[str, Migration]:
    """Blocking `migrate`, for a caller without a running event loop (a cell rank)."""
    return blocking(
        source_url,
        lambda source: migrate(source, routes, transport=transport, ttl_s=ttl_s, timeout=timeout),
        timeout=timeout,
    )


async def migrate(
    source: EngineClient,
    routes: Mapping[str, str],
    *,
    transport: str = "auto",
    ttl_s: float = 120.0,
    timeout: float = 60.0,
) -> dict[str, Migration]:
    """Move the KV of each rid prefix's calls from `source` to its destination URL:
    pin at the source, read + acknowledge at the destinations, release at the source."""
    t0 = time.perf_counter()
    if not routes:
        return {}
    try:
        segments = await source.kv_pin(rid_prefixes=list(routes), ttl_s=ttl_s)
    except EngineError as e:
        outcome = "unsupported" if "HTTP 404" in str(e) else "failed"
        return {s: Migration(s, d, outcome, error=f"pin: {e}") for s, d in routes.items()}
    by_dest: dict[str, list[KVSegment]] = {}
    for seg in segments:
        if seg.selector in routes:
            by_dest.setdefault(routes[seg.selector], []).append(seg)
    try:
        acks = await asyncio.gather(
            *(_import(d, source.base_url, segs, transport, timeout) for d, segs in by_dest.items())
        )
    finally:  # the source keeps the pins until every destination answered
        with contextlib.suppress(EngineError):
            await source.kv_release([s.handle for s in segments])
    seconds = time.perf_counter() - t0
    by_handle = {h: r for ack in acks for h, r in _by_handle(ack).items()}
    return {
        sel: _result(sel, dest, [s for s in segments if s.selector == sel], by_handle, seconds)
        for sel, dest in routes.items()
    }


async def _import(
    dest: str, source: str, segments: list[KVSegment], transport: str, timeout: float
) -> KVImportResult | tuple[list[KVSegment], str]:
    client = EngineClient(dest, timeout=timeout)
    try:
        return await client.kv_import(source, segments, transport=transport, timeout=timeout)
    except EngineError as e:
        return segments, str(e)
    finally:
        client.close()


def _by_handle(ack: KVImportResult | tuple[list[KVSegment], str]) -> dict[str, dict]:
    """Each handle's record in an acknowledgement ({"error": ...} when it was not taken)."""
    if isinstance(ack, KVImportResult):
        return {r["handle"]: r for r in [*ack.imported, *ack.failed]}
    segments, error = ack
    return {s.handle: {"handle": s.handle, "error": error} for s in segments}


def _result(
    selector: str, dest: str, segments: list[KVSegment], records: dict[str, dict], seconds: float
) -> Migration:
    if not segments:
        return Migration(selector, dest, "none", seconds=seconds)
    got = [records.get(s.handle, {"error": "no acknowledgement"}) for s in segments]
    taken = [r for r in got if "error" not in r]
    errors = sorted({str(r["error"]) for r in got if "error" in r})
    outcome = "failed" if not taken else "partial" if errors else "migrated"
    return Migration(
        selector, dest, outcome, segments=len(taken),
        tokens=sum(int(r.get("tokens", 0)) for r in taken),
        nbytes=sum(int(r.get("nbytes", 0)) for r in taken),
        transport=",".join(sorted({str(r.get("transport", "")) for r in taken})),
        seconds=seconds, error="; ".join(errors),
    )  # fmt: skip
