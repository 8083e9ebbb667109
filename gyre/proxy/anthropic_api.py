"""Anthropic Messages on the wire: request parsing, responses and SSE events.

`parse_request(body)` validates a `/v1/messages` body into a `CallRequest`. It follows what
Claude Code sends: `system` as a string or a list of text blocks (cache_control ignored),
`"role": "system"` messages inside `messages`, text / tool_use / tool_result / thinking
blocks; a user message's tool_result blocks become tool messages (in block order), its text
blocks a user message. Image and document blocks become a short placeholder text; server
tools (a `type` other than "custom") are dropped since the policy cannot run them.
`response_body` / `stream_events` answer in Anthropic's shapes: tool calls as `tool_use`
blocks (streamed as `input_json_delta`), stop_reason "tool_use", and SSE with `event:` lines.
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

MEDIA_BLOCKS = ("image", "document", "search_result")
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def parse_request(body: Any) -> CallRequest:
    """Validate an Anthropic messages body; raises ApiError (400) naming the field."""
    check_type(body, dict, "body")
    model = need(body, "model", str, "body")
    max_tokens = positive_int(body, "max_tokens", "body", required=True)
    raw = need(body, "messages", list, "body")
    if not raw:
        raise invalid("body.messages: must contain at least one message", "messages")
    stops = opt(body, "stop_sequences", list, "body") or []
    for i, s in enumerate(stops):
        check_type(s, str, f"body.stop_sequences[{i}]")
    conv = Conversation(system=_system(body.get("system")), tools=_tools(body), messages=[])
    for i, msg in enumerate(raw):
        conv.messages.extend(_message(msg, f"body.messages[{i}]"))
    top_p = nucleus(body, "body")
    return CallRequest(
        api="anthropic",
        model=model,
        conversation=conv,
        max_tokens=max_tokens,
        temperature=number_in(body, "temperature", 0.0, 1.0, "body"),
        top_p=top_p,
        stream=bool(opt(body, "stream", bool, "body")),
        tool_choice=_tool_choice(opt(body, "tool_choice", dict, "body"), conv),
    )


def _system(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    check_type(value, list, "body.system")
    return "\n\n".join(_text_block(b, f"body.system[{i}]") for i, b in enumerate(value))


def _text_block(block: Any, where: str) -> str:
    check_type(block, dict, where)
    kind = need(block, "type", str, where)
    if kind != "text":
        raise invalid(f"{where}.type: {kind!r}; allowed: 'text'", where)
    return str(need(block, "text", str, where))


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    out, seen = [], set()
    for i, tool in enumerate(opt(body, "tools", list, "body") or []):
        where = f"body.tools[{i}]"
        check_type(tool, dict, where)
        if tool.get("type", "custom") not in ("custom", None):
            continue  # a server tool (web search, ...): nothing the policy can call
        name = check_tool_name(need(tool, "name", str, where), f"{where}.name")
        if name in seen:
            raise invalid(f"{where}.name: duplicate tool name {name!r}", "tools")
        seen.add(name)
        schema = check_schema(need(tool, "input_schema", dict, where), f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name}
        description = opt(tool, "description", str, where)
        if description is not None:
            fn["description"] = description
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: dict[str, Any] | None, conv: Conversation) -> ToolChoice:
    if value is None:
        return ToolChoice()
    kind = need(value, "type", str, "body.tool_choice")
    if kind in ("auto", "none"):
        return ToolChoice(mode=kind)
    if kind == "any":
        if not conv.tools:
            raise invalid("body.tool_choice: 'any' needs at least one tool", "tool_choice")
        return ToolChoice(mode="required")
    if kind == "tool":
        name = need(value, "name", str, "body.tool_choice")
        return named_choice(conv, name, "body.tool_choice.name")
    raise invalid(f"body.tool_choice.type: {kind!r}; allowed: auto, any, tool, none", "tool_choice")


def _message(msg: Any, where: str) -> list[Message]:
    check_type(msg, dict, where)
    role = need(msg, "role", str, where)
    if role not in ("user", "assistant", "system"):
        raise invalid(f"{where}.role: {role!r}; allowed: user, assistant, system", where)
    content = msg.get("content")
    if isinstance(content, str):
        blocks: list[Any] = [{"type": "text", "text": content}]
    else:
        blocks = check_type(content, list, f"{where}.content")
    if role == "assistant":
        return [_assistant(blocks, where)]
    out: list[Message] = []
    texts: list[str] = []
    for w, block, kind in typed_items(blocks, f"{where}.content"):
        if kind == "tool_result" and role == "user":
            if texts:
                out.append(Message(role="user", content="\n\n".join(texts)))
                texts = []
            out.append(_tool_result(block, w))
        else:
            texts.append(_plain(block, kind, w))
    if texts or not out:
        out.append(Message(role=role, content="\n\n".join(texts)))  # type: ignore[arg-type]
    return out


def _plain(block: dict[str, Any], kind: str, where: str) -> str:
    if kind == "text":
        return str(need(block, "text", str, where))
    if kind in MEDIA_BLOCKS:
        return f"[{kind} omitted]"
    raise invalid(f"{where}.type: {kind!r}; allowed: text, tool_result, image, document", where)


def _tool_result(block: dict[str, Any], where: str) -> Message:
    call_id = need(block, "tool_use_id", str, where)
    opt(block, "is_error", bool, where)
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    else:
        parts = check_type(content, list, f"{where}.content")
        chunks = [
            _plain(part, kind, where) for _, part, kind in typed_items(parts, f"{where}.content")
        ]
        text = "\n\n".join(chunks)
    return Message(role="tool", content=text, tool_call_id=call_id)


def _assistant(blocks: list[Any], where: str) -> Message:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for w, block, kind in typed_items(blocks, f"{where}.content"):
        if kind == "text":
            texts.append(need(block, "text", str, w))
        elif kind == "tool_use":
            name = need(block, "name", str, w)
            args = arguments_text(need(block, "input", dict, w), f"{w}.input")
            calls.append(ToolCall(id=need(block, "id", str, w), name=name, arguments=args))
        elif kind not in SKIPPED_BLOCKS:
            raise invalid(f"{w}.type: {kind!r}; allowed in assistant turns: text, tool_use", w)
    return Message(role="assistant", content="".join(texts), tool_calls=calls)


# -- responses ------------------------------------------------------------------------------


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    return blocks


def _message_head(reply: Reply, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": reply.id,
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0},
    }


def response_body(reply: Reply) -> dict[str, Any]:
    """The non-streaming message object."""
    body = _message_head(reply, _blocks(reply))
    body["stop_reason"] = STOP[reply.finish]
    body["usage"]["output_tokens"] = reply.completion_tokens
    return body


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def stream_events(reply: Reply, *, piece: int = 64) -> Iterator[str]:
    """SSE events for a finished reply, each with an `event:` line, ending in message_stop."""
    yield _event("message_start", {"message": _message_head(reply, [])})
    for index, block in enumerate(_blocks(reply)):
        if block["type"] == "text":
            yield _event(
                "content_block_start",
                {"index": index, "content_block": {"type": "text", "text": ""}},
            )
            for s in range(0, len(block["text"]), piece):
                delta = {"type": "text_delta", "text": block["text"][s : s + piece]}
                yield _event("content_block_delta", {"index": index, "delta": delta})
        else:
            start = {**block, "input": {}}
            yield _event("content_block_start", {"index": index, "content_block": start})
            text = json.dumps(block["input"], ensure_ascii=False)
            for s in range(0, len(text), piece):
                delta = {"type": "input_json_delta", "partial_json": text[s : s + piece]}
                yield _event("content_block_delta", {"index": index, "delta": delta})
        yield _event("content_block_stop", {"index": index})
    delta = {"stop_reason": STOP[reply.finish], "stop_sequence": None}
    yield _event(
        "message_delta", {"delta": delta, "usage": {"output_tokens": reply.completion_tokens}}
    )
    yield _event("message_stop", {})
