"""Route table and rerouting: which engine serves each execution's next call.

The coordinator sets routes (execution -> engine id) and marks engines draining when their
cell switches from rollout to training; the proxy follows. A call whose engine aborts it
(finish type "abort", e.g. the cell is switching role) or fails is retried with the same
input at the execution's current route, after waiting (bounded) for the coordinator to move
the execution; the harness sees one ordinary response and the node records `attempts`.
An execution without a route, or routed to a draining engine, gets the non-draining engine
with the fewest executions routed to it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gyre.errors import EngineError, ProtocolError
from gyre.proxy.errors import ApiError
from gyre.rollout.protocol import GenerateResult, SamplingParams, ScoreResult

# EngineClient reports HTTP errors as "... HTTP <code>: ..."; a 4xx other than 408 / 429 means
# the engine refuses this input (e.g. too long for the model), which a retry cannot fix.
REFUSED = re.compile(r"HTTP (?!408|429)4\d\d")


class EngineLike(Protocol):
    """What the router needs from an engine client (gyre.rollout.client.EngineClient)."""

    async def generate(
        self, input_ids: Sequence[int] | np.ndarray, sampling: SamplingParams, rid: str,
        routed_from: int | None = None,
    ) -> GenerateResult: ...  # fmt: skip

    async def score(
        self, input_ids: Sequence[int] | np.ndarray, start: int, rid: str
    ) -> ScoreResult: ...


@dataclass(slots=True)
class Served:
    """A finished generation and where it was produced."""

    result: GenerateResult
    engine_id: str
    attempts: int


class Router:
    """Engines by id, the route table, draining marks, and generate-with-reroute."""

    def __init__(self, *, attempts: int, wait_s: float, poll_s: float = 0.01) -> None:
        self.engines: dict[str, EngineLike] = {}
        self.routes: dict[str, str] = {}
        self.draining: set[str] = set()
        self.attempts = attempts
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.same_engine_grace_s = min(wait_s, 1.0)

    # -- table ----------------------------------------------------------------------------------

    def add_engine(self, engine_id: str, client: EngineLike) -> None:
        self.engines[engine_id] = client
        self.draining.discard(engine_id)

    def set_route(self, execution_id: str, engine_id: str) -> None:
        self._known(engine_id)
        self.routes[execution_id] = engine_id

    def set_draining(self, engine_id: str, draining: bool = True) -> None:
        self._known(engine_id)
        if draining:
            self.draining.add(engine_id)
        else:
            self.draining.discard(engine_id)

    def forget(self, execution_id: str) -> None:
        self.routes.pop(execution_id, None)

    def table(self) -> dict[str, Any]:
        return {
            "routes": dict(self.routes),
            "engines": sorted(self.engines),
            "draining": sorted(self.draining),
        }

    def _known(self, engine_id: str) -> None:
        if engine_id not in self.engines:
            raise ApiError(
                "not_found",
                f"engine {engine_id!r} is not known; known engines: {sorted(self.engines)}",
            )

    def pick(self, execution_id: str) -> str | None:
        """The execution's engine; (re)assigns it if unrouted or routed to a draining engine."""
        current = self.routes.get(execution_id)
        if current is not None and current not in self.draining and current in self.engines:
            return current
        live = [e for e in self.engines if e not in self.draining]
        if not live:
            return None
        load = Counter(self.routes.values())
        choice = min(live, key=lambda e: (load[e], e))
        self.routes[execution_id] = choice
        return choice

    # -- serving ----------------------------------------------------------------------------

    async def generate(
        self,
        execution_id: str,
        input_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        rid: str,
        routed_from: int | None = None,
    ) -> Served:
        """Generate at the execution's engine; retry aborted/failed attempts at its new route.
        `routed_from`: ask for the routed experts of the positions from there on."""
        failed: str | None = None
        reason = ""
        for attempt in range(1, self.attempts + 1):
            engine_id = await self._await_engine(execution_id, failed)
            try:
                result = await self.engines[engine_id].generate(
                    input_ids, sampling, f"{rid}-{attempt}", routed_from
                )
            except (EngineError, ProtocolError, OSError) as e:
                if REFUSED.search(str(e)):  # the engine rejects this input: retrying won't help
                    raise ApiError("invalid_request", f"the engine refused the call: {e}") from None
                failed, reason = engine_id, f"engine {engine_id} failed: {e}"
                continue
            if result.finish_type != "abort":
                return Served(result=result, engine_id=engine_id, attempts=attempt)
            failed, reason = engine_id, f"engine {engine_id} aborted: {result.message}"
        raise ApiError(
            "overloaded",
            f"no engine finished the call in {self.attempts} attempts "
            f"(last: {reason}); retry later",
        )

    async def _await_engine(self, execution_id: str, failed: str | None) -> str:
        """Wait until the execution has a live engine, preferring one other than `failed`."""
        start = time.monotonic()
        while True:
            engine_id = self.pick(execution_id)
            waited = time.monotonic() - start
            if engine_id is not None and (
                engine_id != failed or waited >= self.same_engine_grace_s
            ):
                return engine_id
            if waited >= self.wait_s:
                if engine_id is not None:
                    return engine_id
                raise ApiError("overloaded", "no rollout engine is accepting calls; retry later")
            await asyncio.sleep(self.poll_s)
