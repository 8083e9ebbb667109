"""One internal conversation shape for both client APIs, plus shared field validation.

OpenAI Chat Completions, OpenAI Responses and Anthropic Messages requests are all normalized
into a `CallRequest`: a `Conversation` (header = system text + tools in OpenAI function form,
then messages with role system / user / assistant / tool) and the sampling fields. TITO
matching, rendering and recording only ever see this shape; `openai_api`, `responses_api`
and `anthropic_api` own the translation in and out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from gyre.proxy.errors import invalid
from gyre.proxy.jsonbody import check_depth, decode_json, has_surrogates, without_surrogates

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(slots=True)
class ToolCall:
    """One function call inside an assistant message; `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Message:
    """One normalized chat message."""

    role: Role
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # role "tool": the call this result answers


@dataclass(slots=True)
class Conversation:
    """Header (system text, tools) plus messages: what the chat template renders."""

    system: str | None
    tools: list[
        dict[str, Any]
    ]  # [{"type": "function", "function": {name, description, parameters}}]
    messages: list[Message]

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def tool_schema(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {}
        return {}


@dataclass(slots=True)
class ToolChoice:
    """auto: free text; none: never parse tool calls; required: some tool; named: that tool."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None


@dataclass(slots=True)
class CallRequest:
    """A validated model call from either API."""

    api: Literal["openai", "anthropic", "responses"]
    model: str
    conversation: Conversation
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stream: bool
    tool_choice: ToolChoice
    include_usage: bool = False  # OpenAI stream_options.include_usage
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Responses API: internal tool name "ns.name" -> (namespace, name) of namespaced tools


# -- field validation shared by the parsers ------------------------------------------------


def need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """obj[key], which must exist and be of `kind` (bool is never an int or float here)."""
    if key not in obj:
        raise invalid(f"{where}.{key}: required field is missing", f"{where}.{key}")
    return check_type(obj[key], kind, f"{where}.{key}")


def opt(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """obj[key] or None; if present (and not null) it must be of `kind`."""
    value = obj.get(key)
    return None if value is None else check_type(value, kind, f"{where}.{key}")


def check_type(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise invalid(f"{where}: expected {names}, got {_json_type(value)}", where)
    return value


_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    dict: "an object",
    list: "an array",
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for k, name in _TYPE_NAMES.items():
        if isinstance(value, k):
            return name
    return type(value).__name__


def number_in(obj: dict[str, Any], key: str, lo: float, hi: float, where: str) -> float | None:
    """An optional finite number within [lo, hi]."""
    value = opt(obj, key, (int, float), where)
    if value is None:
        return None
    if not lo <= value <= hi:  # NaN and infinities fail it too
        shown = value if isinstance(value, float) or abs(value) < 10**12 else "a huge integer"
        raise invalid(
            f"{where}.{key}: {shown} is out of range; allowed: a number in {lo}..{hi}", key
        )
    return float(value)


def nucleus(obj: dict[str, Any], where: str) -> float | None:
    """The optional `top_p` of obj: a nucleus mass in (0, 1]."""
    value = number_in(obj, "top_p", 0.0, 1.0, where)
    if value == 0.0:
        raise invalid(f"{where}.top_p: 0; allowed: a number in (0, 1]", "top_p")
    return value


def positive_int(obj: dict[str, Any], key: str, where: str, *, required: bool) -> int | None:
    value = need(obj, key, int, where) if required else opt(obj, key, int, where)
    if value is not None and value < 1:
        raise invalid(f"{where}.{key}: {value}; allowed: an integer >= 1", key)
    return value


def typed_items(items: list[Any], where: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(path, item, its `type`) of each item of a list of typed objects (content blocks,
    content parts), each checked to be an object with a string `type`."""
    for j, item in enumerate(items):
        path = f"{where}[{j}]"
        check_type(item, dict, path)
        yield path, item, need(item, "type", str, path)


def arguments_text(value: Any, where: str) -> str:
    """Tool-call arguments as JSON text; must hold (or be) a JSON object.

    A string is kept byte for byte unless its JSON holds lone surrogates (escaped inside
    the text): then it is re-serialized with U+FFFD in their place, as `decode_body` does
    for the request itself."""
    if isinstance(value, dict):
        return json.dumps(check_depth(value, where), ensure_ascii=False)
    check_type(value, str, where)
    parsed = decode_json(value, where)
    if not isinstance(parsed, dict):
        raise invalid(f"{where}: arguments must be a JSON object", where)
    check_depth(parsed, where)
    if "\\u" in value and _holds_surrogates(parsed):
        return json.dumps(without_surrogates(parsed), ensure_ascii=False)
    return value


def _holds_surrogates(value: Any) -> bool:
    return has_surrogates(json.dumps(value, ensure_ascii=False))


def check_schema(schema: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool's JSON schema: bounded nesting; `properties` an object and `required` an
    array of strings where given (the proxy reads both to force a call). Other keywords
    are the engine's to judge (a grammar it cannot build is its 400)."""
    check_depth(schema, where)
    opt(schema, "properties", dict, where)
    for i, name in enumerate(opt(schema, "required", list, where) or []):
        check_type(name, str, f"{where}.required[{i}]")
    return schema


def check_tool_name(name: str, where: str) -> str:
    if not name or len(name) > 128:
        raise invalid(f"{where}: tool name must be 1-128 characters", where)
    return name


def named_choice(conv: Conversation, name: str, where: str) -> ToolChoice:
    """tool_choice naming one tool, which must be one of the request's (`where`: the name's
    field)."""
    if name not in conv.tool_names():
        raise invalid(
            f"{where}: {name!r} is not one of the request's tools {conv.tool_names()}",
            "tool_choice",
        )
    return ToolChoice(mode="named", name=name)


def check_tool_results(conv: Conversation, issued: set[str] | dict[str, Any]) -> None:
    """Every tool result must answer a call this execution issued or this request declares."""
    declared: set[str] = set()
    for i, m in enumerate(conv.messages):
        if m.role == "assistant":
            declared.update(c.id for c in m.tool_calls)
        elif m.role == "tool" and m.tool_call_id not in declared and m.tool_call_id not in issued:
            raise invalid(
                f"messages[{i}]: tool result for unknown tool call id {m.tool_call_id!r}; "
                "allowed: ids of tool calls issued earlier in this execution",
                "tool_call_id",
            )


@dataclass(slots=True)
class Reply:
    """What one served call answers, before it is put in an API's shape."""

    id: str
    model: str
    content: str  # text outside tool calls, stripped
    tool_calls: list[ToolCall]
    finish: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    created: int  # unix seconds
