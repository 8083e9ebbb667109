"""`EngineClient`: async client of one rollout engine over SGLang's native HTTP protocol.

The proxy and the coordinator drive engines only through this class, and it sends only
SGLang fields, so the same code drives the embedded CPU engine and real SGLang servers
(the one exception, `request_log`, reads the embedded engine's debugging route). Every
failure (connection refused, timeout, HTTP error, malformed body) raises `EngineError`
carrying the engine id, the route and the server's message; an aborted generation is not
an error: it returns a `GenerateResult` with ``finish_type == "abort"``.

    client = EngineClient("http://127.0.0.1:30000", engine_id="e0")
    result = await client.generate(ids, SamplingParams(max_new_tokens=64), rid="x-1")
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gyre.errors import EngineError, ProtocolError
from gyre.rollout.protocol import GenerateResult, SamplingParams

if TYPE_CHECKING:
    import torch

# Many concurrent calls per engine (one per live harness): raise Tornado's default of 10.
AsyncHTTPClient.configure(None, max_clients=1024)


class EngineClient:
    """One engine's routes as async methods."""

    def __init__(
        self,
        base_url: str,
        *,
        engine_id: str | None = None,
        timeout: float = 3600.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_id = engine_id or self.base_url
        self.timeout = timeout
        self.connect_timeout = connect_timeout

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str
    ) -> GenerateResult:
        """One /generate call with behaviour log-probs."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_json(),
            "return_logprob": True,
            "rid": rid,
        }
        reply = await self._call("POST", "/generate", body)
        try:
            return GenerateResult.from_response(reply)
        except ProtocolError as e:
            raise EngineError(f"engine {self.engine_id}: {e}") from e

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: str = "retract") -> None:
        """Hold generation at a step boundary; in-flight calls wait ("retract"/"in_place")
        or end as aborted ("abort")."""
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", {})

    async def health(self) -> bool:
        """True if the engine answers /health with 200 (never raises)."""
        try:
            await self._call("GET", "/health", None, timeout=5.0)
        except EngineError:
            return False
        return True

    async def weight_version(self) -> str:
        return str((await self._call("GET", "/get_weight_version", None))["weight_version"])

    async def model_info(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/get_model_info", None))

    async def release_memory(self) -> None:
        await self._call("POST", "/release_memory_occupation", {})

    async def resume_memory(self) -> None:
        await self._call("POST", "/resume_memory_occupation", {})

    async def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str | None = None
    ) -> None:
        """Load named CPU tensors (embedded engine's torch_save wire format) and set version."""
        from gyre.rollout.weights import encode_named_tensors

        body = {
            "serialized_named_tensors": [encode_named_tensors(named_tensors)],
            "load_format": "torch_save",
            "flush_cache": True,
            "weight_version": version,
        }
        await self._call("POST", "/update_weights_from_tensor", body)

    async def request_log(self) -> list[dict[str, Any]]:
        """Embedded engine only: the /generate calls it received, oldest first
        (each {"rid", "input_ids", "t"})."""
        return list((await self._call("GET", "/gyre/requests", None))["requests"])

    async def clear_request_log(self) -> None:
        """Embedded engine only: forget the received-request log."""
        await self._call("DELETE", "/gyre/requests", None)

    async def stats(self) -> dict[str, Any]:
        """Embedded engine only: queue lengths and decode steps by batch size."""
        return dict(await self._call("GET", "/gyre/stats", None))

    async def _call(
        self, method: str, route: str, body: Any, *, timeout: float | None = None
    ) -> Any:
        request = HTTPRequest(
            self.base_url + route,
            method=method,
            body=None if body is None else json.dumps(body),
            headers={"Content-Type": "application/json"},
            request_timeout=timeout or self.timeout,
            connect_timeout=self.connect_timeout,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as e:
            raise EngineError(
                f"engine {self.engine_id} {route}: HTTP {e.code}: {_message(e)}"
            ) from None
        except OSError as e:
            raise EngineError(f"engine {self.engine_id} {route}: cannot connect: {e}") from None
        text = response.body.decode() if response.body else ""
        try:
            return json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            return {"text": text}


def _message(e: HTTPClientError) -> str:
    body = e.response.body if e.response is not None else b""
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return (body or b"").decode(errors="replace")[:500] or str(e.message)
