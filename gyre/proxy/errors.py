"""Client-facing proxy errors and their two wire shapes (OpenAI and Anthropic).

Every refusal the proxy sends a harness is an `ApiError` carrying an HTTP status, a generic
kind and a message naming what was wrong and what is allowed. Each API's handler turns it
into that API's own error body in exactly one place (`openai_error_body` /
`anthropic_error_body`), so validation code never thinks about wire shapes.
"""

from __future__ import annotations

from typing import Any

from gyre.errors import ProtocolError

# kind -> (HTTP status, OpenAI error type, OpenAI code, Anthropic error type)
KINDS: dict[str, tuple[int, str, str | None, str]] = {
    "invalid_request": (400, "invalid_request_error", None, "invalid_request_error"),
    "authentication": (401, "invalid_request_error", "invalid_api_key", "authentication_error"),
    "permission": (403, "permission_error", "permission_denied", "permission_error"),
    "not_found": (404, "invalid_request_error", "not_found", "not_found_error"),
    "conflict": (409, "invalid_request_error", "conflict", "invalid_request_error"),
    "too_large": (413, "invalid_request_error", "request_too_large", "request_too_large"),
    "overloaded": (503, "server_error", "overloaded", "overloaded_error"),
    "api_error": (500, "server_error", None, "api_error"),
}
ANTHROPIC_OVERLOADED_STATUS = 529


class ApiError(ProtocolError):
    """A request the proxy refuses; `kind` is a key of `KINDS`."""

    def __init__(self, kind: str, message: str, *, param: str | None = None) -> None:
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]


def invalid(message: str, param: str | None = None) -> ApiError:
    """Shorthand for a 400 invalid_request error."""
    return ApiError("invalid_request", message, param=param)


def shutting_down() -> ApiError:
    """The answer to a call the proxy cannot finish because it is stopping (retryable)."""
    return ApiError("overloaded", "the proxy is shutting down; retry the call")


def openai_error_body(err: ApiError) -> tuple[int, dict[str, Any]]:
    """(status, body) in OpenAI's shape: {"error": {message, type, param, code}}."""
    status, etype, code, _ = KINDS[err.kind]
    return status, {
        "error": {"message": err.message, "type": etype, "param": err.param, "code": code}
    }


def anthropic_error_body(err: ApiError) -> tuple[int, dict[str, Any]]:
    """(status, body) in Anthropic's shape: {"type": "error", "error": {type, message}}."""
    status, _, _, etype = KINDS[err.kind]
    if err.kind == "overloaded":
        status = ANTHROPIC_OVERLOADED_STATUS
    return status, {"type": "error", "error": {"type": etype, "message": err.message}}
