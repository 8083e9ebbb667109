"""OpenAI Chat Completions on the wire: request parsing, responses and SSE chunks.

`parse_request(body)` validates a `/v1/chat/completions` body and returns a `CallRequest`
(leading system / developer messages become the header's system text; later ones stay
inline as system messages). `response_body(reply)` and `stream_chunks(reply)` put a
`Reply` into OpenAI's JSON and server-sent-event shapes (tool calls as `tool_calls`,
finish_reason "tool_calls", stream ends with `data: [DONE]`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from gyre.proxy.conversation import (
    CallRequest,
    Conversation,
    Message,
    Reply,
    ToolCall,
    ToolChoice,
    arguments_text,
    check_schema,
    check_tool_name,
    check_type,
    named_choice,
    need,
    nucleus,
    number_in,
    opt,
    positive_int,
    typed_items,
)
from gyre.proxy.errors import invalid

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_request(body: Any) -> CallRequest:
    """Validate an OpenAI chat-completions body; raises ApiError (400) naming the field."""
    check_type(body, dict, "body")
    model = need(body, "model", str, "body")
    raw = need(body, "messages", list, "body")
    if not raw:
        raise invalid("body.messages: must contain at least one message", "messages")
    tools = _tools(body)
    conv = _conversation(raw, tools)
    n = opt(body, "n", int, "body")
    if n not in (None, 1):
        raise invalid(f"body.n: {n}; allowed: 1", "n")
    max_tokens = positive_int(body, "max_completion_tokens", "body", required=False)
    if max_tokens is None:
        max_tokens = positive_int(body, "max_tokens", "body", required=False)
    stream = bool(opt(body, "stream", bool, "body"))
    options = opt(body, "stream_options", dict, "body") or {}
    return CallRequest(
        api="openai",
        model=model,
        conversation=conv,
        max_tokens=max_tokens,
        temperature=number_in(body, "temperature", 0.0, 2.0, "body"),
        top_p=nucleus(body, "body"),
        stream=stream,
        tool_choice=_tool_choice(body.get("tool_choice"), conv),
        include_usage=bool(opt(options, "include_usage", bool, "body.stream_options")),
    )


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = opt(body, "tools", list, "body") or []
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"body.tools[{i}]"
        check_type(tool, dict, where)
        if tool.get("type", "function") != "function":
            raise invalid(f"{where}.type: {tool.get('type')!r}; allowed: 'function'", "tools")
        fn = need(tool, "function", dict, where)
        name = check_tool_name(need(fn, "name", str, f"{where}.function"), f"{where}.function.name")
        if name in seen:
            raise invalid(f"{where}.function.name: duplicate tool name {name!r}", "tools")
        seen.add(name)
        kept: dict[str, Any] = {"name": name}  # what templates read; other keys are dropped
        description = opt(fn, "description", str, f"{where}.function")
        if description is not None:
            kept["description"] = description
        params = opt(fn, "parameters", dict, f"{where}.function")
        if params is not None:
            kept["parameters"] = check_schema(params, f"{where}.function.parameters")
        out.append({"type": "function", "function": kept})
    return out


def tool_mode(value: Any, conv: Conversation) -> ToolChoice | None:
    """The tool_choice strings of both OpenAI APIs ("auto", "none", "required"; absent is
    "auto"); None when `value` is not one of them."""
    if value is None or value == "auto":
        return ToolChoice()
    if value in ("none", "required"):
        if value == "required" and not conv.tools:
            raise invalid("body.tool_choice: 'required' needs at least one tool", "tool_choice")
        return ToolChoice(mode=value)
    return None


def _tool_choice(value: Any, conv: Conversation) -> ToolChoice:
    mode = tool_mode(value, conv)
    if mode is not None:
        return mode
    if isinstance(value, dict) and value.get("type") == "function":
        fn = need(value, "function", dict, "body.tool_choice")
        name = need(fn, "name", str, "body.tool_choice.function")
        return named_choice(conv, name, "body.tool_choice.function.name")
    raise invalid(
        "body.tool_choice: allowed 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _text(content: Any, where: str, *, allow_null: bool) -> str:
    if content is None:
        if allow_null:
            return ""
        raise invalid(f"{where}: required field is missing", where)
    if isinstance(content, str):
        return content
    check_type(content, list, where)
    parts = []
    for w, part, kind in typed_items(content, where):
        if kind not in ("text", "input_text"):
            raise invalid(f"{w}.type: {kind!r} is not supported; allowed: 'text'", where)
        parts.append(need(part, "text", str, w))
    return "".join(parts)


def _conversation(raw: list[Any], tools: list[dict[str, Any]]) -> Conversation:
    system: list[str] = []
    messages: list[Message] = []
    for i, msg in enumerate(raw):
        where = f"body.messages[{i}]"
        check_type(msg, dict, where)
        role = need(msg, "role", str, where)
        if role not in ROLES:
            raise invalid(f"{where}.role: {role!r}; allowed: {', '.join(ROLES)}", "messages")
        if role in ("system", "developer"):
            text = _text(msg.get("content"), f"{where}.content", allow_null=False)
            if messages:
                messages.append(Message(role="system", content=text))
            else:
                system.append(text)
        elif role == "user":
            messages.append(
                Message(
                    role="user",
                    content=_text(msg.get("content"), f"{where}.content", allow_null=False),
                )
            )
        elif role == "tool":
            call_id = need(msg, "tool_call_id", str, where)
            text = _text(msg.get("content"), f"{where}.content", allow_null=False)
            messages.append(Message(role="tool", content=text, tool_call_id=call_id))
        else:
            messages.append(_assistant(msg, where))
    return Conversation(
        system="\n\n".join(system) if system else None, tools=tools, messages=messages
    )


def _assistant(msg: dict[str, Any], where: str) -> Message:
    calls = []
    for j, call in enumerate(opt(msg, "tool_calls", list, where) or []):
        w = f"{where}.tool_calls[{j}]"
        check_type(call, dict, w)
        call_id = need(call, "id", str, w)
        fn = need(call, "function", dict, w)
        name = need(fn, "name", str, f"{w}.function")
        args = arguments_text(fn.get("arguments", "{}"), f"{w}.function.arguments")
        calls.append(ToolCall(id=call_id, name=name, arguments=args))
    text = _text(msg.get("content"), f"{where}.content", allow_null=True)
    return Message(role="assistant", content=text, tool_calls=calls)


# -- responses ------------------------------------------------------------------------------

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def response_body(reply: Reply) -> dict[str, Any]:
    """The non-streaming chat.completion object."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = _calls_json(reply.tool_calls)
    elif not reply.content:
        message["content"] = ""
    return {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": FINISH[reply.finish],
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }


def stream_chunks(reply: Reply, *, include_usage: bool, piece: int = 64) -> Iterator[str]:
    """SSE lines ("data: {...}\\n\\n") for a finished reply, ending with data: [DONE]."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body = {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for start in range(0, len(reply.content), piece):
        yield chunk({"content": reply.content[start : start + piece]})
    for i, call in enumerate(reply.tool_calls):
        head = {"index": i, "id": call.id, "type": "function"}
        yield chunk({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
        for start in range(0, len(call.arguments), piece):
            part = call.arguments[start : start + piece]
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": part}}]})
    yield chunk({}, FINISH[reply.finish])
    if include_usage:
        body = {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "choices": [],
            "usage": _usage(reply),
        }
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def models_body(names: list[str]) -> dict[str, Any]:
    """GET /v1/models in a shape both SDKs read (OpenAI's fields plus Anthropic's)."""
    data = [
        {
            "id": n,
            "object": "model",
            "created": 0,
            "owned_by": "gyre",
            "type": "model",
            "display_name": n,
            "created_at": "1970-01-01T00:00:00Z",
        }
        for n in names
    ]
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }
