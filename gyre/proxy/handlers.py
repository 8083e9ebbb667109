"""Tornado handlers for the harness-facing APIs: one error boundary per API.

`OpenAIChatHandler` (POST /v1/chat/completions), `ResponsesHandler` (POST /v1/responses)
and `AnthropicMessagesHandler` (POST /v1/messages) share `ApiHandler`: read the body
(streamed, so an oversized body gets a proper 413 instead of a dropped connection),
authenticate, decode (`gyre.proxy.jsonbody`: strict JSON, lone surrogates coerced), parse,
serve, answer JSON or SSE. Any `ApiError` (and, as a last resort, any other exception as a
500) becomes that API's own error body in `send_error_body`. An optional path prefix
`/e/<execution_id>` pins a base URL to one execution: a key of another execution then gets
403.

A model call in flight is registered with the service while it runs: when the proxy stops
(`ProxyService.close`), `abort` answers it at once with the retryable overloaded error
(503, Anthropic 529 `overloaded_error`, `retry-after` and `x-should-retry: true`, which both
SDKs and Claude Code retry) and cancels the rest of it, so no node is recorded for it. A
call cancelled by its event loop's end gets the same answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, ClassVar

import orjson
import tornado.web

from gyre.proxy import anthropic_api, openai_api, responses_api
from gyre.proxy.errors import (
    ApiError,
    anthropic_error_body,
    openai_error_body,
    shutting_down,
)
from gyre.proxy.jsonbody import decode_body
from gyre.proxy.service import ProxyService, header_lines
from gyre.vocabulary import PROVENANCE_HEADER

log = logging.getLogger(__name__)
DISCARD_LIMIT = 1 << 30  # bodies beyond this are cut by the connection itself
STATUS_KIND = {401: "authentication", 403: "permission", 404: "not_found", 413: "too_large"}


def bearer_key(headers: Any) -> str | None:
    """The key from `x-api-key` or `Authorization: Bearer <key>`."""
    key = headers.get("x-api-key")
    if key:
        return str(key).strip()
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return str(auth[7:].strip()) or None
    return None


class JsonErrorHandler(tornado.web.RequestHandler):
    """Base: errors in an API's shape (Anthropic if `anthropic-version` is sent)."""

    api: ClassVar[str | None] = None

    def initialize(self, service: ProxyService) -> None:
        self.service = service

    def api_name(self) -> str:
        if self.api:
            return self.api
        return "anthropic" if "anthropic-version" in self.request.headers else "openai"

    def send_error_body(self, err: ApiError) -> None:
        """Answer `err` in this API's shape (nothing, if an answer was already sent)."""
        if self._finished:
            return
        shape = anthropic_error_body if self.api_name() == "anthropic" else openai_error_body
        status, body = shape(err)
        self.clear()
        self.set_status(status)
        if err.kind == "overloaded":
            self.set_header("retry-after", "1")
            self.set_header("x-should-retry", "true")
        self.send_json(body)

    def send_json(self, body: Any) -> None:
        self.set_header("Content-Type", "application/json")
        try:
            data = orjson.dumps(body)
        except TypeError:  # e.g. a lone surrogate echoed from a request: JSON escapes it
            data = json.dumps(body).encode()
        self.finish(data)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            err = exc
        elif status_code >= 500:
            err = ApiError("api_error", "internal proxy error; see the proxy log")
        else:
            kind = STATUS_KIND.get(status_code, "invalid_request")
            err = ApiError(kind, f"HTTP {status_code}: {self._reason}")
        shape = anthropic_error_body if self.api_name() == "anthropic" else openai_error_body
        status, body = shape(err)
        self.set_status(status if isinstance(exc, ApiError) else status_code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, ApiError):
            return
        super().log_exception(typ, value, tb)


@tornado.web.stream_request_body
class ApiHandler(JsonErrorHandler):
    """A model call: body -> key -> request -> serve -> JSON or SSE."""

    def prepare(self) -> None:
        self._body = bytearray()
        self._too_large = False
        self._task: asyncio.Task[Any] | None = None
        if self.request.method == "POST":
            self.request.connection.set_max_body_size(DISCARD_LIMIT)  # type: ignore[union-attr]
        length = self.request.headers.get("Content-Length")
        if length and length.isdigit() and int(length) > self.service.config.max_body_bytes:
            self._too_large = True

    def data_received(self, chunk: bytes) -> None:
        if self._too_large:
            return
        self._body += chunk
        if len(self._body) > self.service.config.max_body_bytes:
            self._too_large = True
            self._body = bytearray()

    def parse(self, body: Any) -> Any:
        raise NotImplementedError

    async def post(self, execution_id: str | None = None) -> None:
        self._task = asyncio.current_task()
        self.service.calls.add(self)
        try:
            await self._post(execution_id)
        except ApiError as e:
            self.send_error_body(e)
        except asyncio.CancelledError:  # `abort` (the proxy stops) or the end of the loop
            self.send_error_body(shutting_down())
        finally:
            self.service.calls.discard(self)

    def abort(self, err: ApiError) -> None:
        """Answer `err` now and cancel the rest of the call (called when the proxy stops)."""
        self.send_error_body(err)
        if self._task is not None:
            self._task.cancel()

    async def _post(self, execution_id: str | None) -> None:
        limit = self.service.config.max_body_bytes
        if self._too_large:
            raise ApiError("too_large", f"request body exceeds the limit of {limit} bytes")
        ex = self.service.authenticate(bearer_key(self.request.headers), execution_id)
        body = decode_body(bytes(self._body))
        req = self.parse(body)
        headers = self.request.headers
        await self.service.serve(
            ex,
            req,
            role=headers.get("x-gyre-role"),
            provenance=headers.get(PROVENANCE_HEADER),
            headers=header_lines(headers.get_all()),
            respond=lambda reply: self.respond(reply, req),
        )

    def respond(self, reply: Any, req: Any) -> None:
        """Send the reply (the service records the call right after)."""
        if req.stream:
            self.set_header("Content-Type", "text/event-stream")
            self.set_header("Cache-Control", "no-cache")
            for event in self.events(reply, req):
                self.write(event)
            self.finish()
        else:
            self.send_json(self.body(reply, req))

    def events(self, reply: Any, req: Any) -> Any:
        raise NotImplementedError

    def body(self, reply: Any, req: Any) -> Any:
        raise NotImplementedError


class OpenAIChatHandler(ApiHandler):
    api = "openai"

    def parse(self, body: Any) -> Any:
        return openai_api.parse_request(body)

    def events(self, reply: Any, req: Any) -> Any:
        return openai_api.stream_chunks(reply, include_usage=req.include_usage)

    def body(self, reply: Any, req: Any) -> Any:
        return openai_api.response_body(reply)


class ResponsesHandler(ApiHandler):
    api = "openai"  # the Responses API answers errors in OpenAI's shape

    def parse(self, body: Any) -> Any:
        return responses_api.parse_request(body)

    def events(self, reply: Any, req: Any) -> Any:
        return responses_api.stream_events(reply, req)

    def body(self, reply: Any, req: Any) -> Any:
        return responses_api.response_body(reply, req)


class AnthropicMessagesHandler(ApiHandler):
    api = "anthropic"

    def parse(self, body: Any) -> Any:
        return anthropic_api.parse_request(body)

    def events(self, reply: Any, req: Any) -> Any:
        return anthropic_api.stream_events(reply)

    def body(self, reply: Any, req: Any) -> Any:
        return anthropic_api.response_body(reply)


class ModelsHandler(JsonErrorHandler):
    """GET /v1/models: the served model names (any valid key)."""

    def get(self, execution_id: str | None = None) -> None:
        try:
            self.service.authenticate(bearer_key(self.request.headers), execution_id)
        except ApiError as e:
            self.send_error_body(e)
            return
        self.send_json(openai_api.models_body(self.service.config.model_names))


class RootHandler(JsonErrorHandler):
    """HEAD / and GET / (Claude Code probes the base URL first)."""

    def head(self, execution_id: str | None = None) -> None:
        self.set_status(200)

    def get(self, execution_id: str | None = None) -> None:
        self.send_json({"status": "ok", "service": "gyre-proxy"})


class NotFoundHandler(JsonErrorHandler):
    """Any other path: 404 in the guessed API's shape."""

    def prepare(self) -> None:
        self.send_error_body(
            ApiError("not_found", f"no route {self.request.method} {self.request.path}")
        )


PREFIX = r"(?:/e/([A-Za-z0-9_.:@-]+))?"
ROUTES: list[tuple[str, type[JsonErrorHandler]]] = [
    (PREFIX + r"/v1/chat/completions", OpenAIChatHandler),
    (PREFIX + r"/v1/responses", ResponsesHandler),
    (PREFIX + r"/v1/messages", AnthropicMessagesHandler),
    (PREFIX + r"/v1/models", ModelsHandler),
    (PREFIX + r"/?", RootHandler),
]
