"""OpenAI Responses API on the wire (`POST /v1/responses`): parsing, response objects, SSE.

Codex CLI speaks only this API. `parse_request(body)` validates a Responses body into the
shared `CallRequest`, so matching, TITO rendering, payload restoration and recording are the
same code as for the other two APIs:

* `instructions` and leading `system` / `developer` messages form the header's system text;
  later ones stay inline as system messages;
* `message` items (also the short `{"role", "content"}` form) with `input_text` /
  `output_text` parts (images and files become a short placeholder text);
* `function_call` items join the assistant message they follow (one reply = one assistant
  message, as the proxy recorded it); `function_call_output` items become tool messages;
* `reasoning` items are kept out of the rendering: the reply they belong to is matched by
  its text and calls, and its recorded output tokens (reasoning included) are reused as is;
* `tools` of type `function`, and the functions of `namespace` tools (called `ns.name`
  inside, answered with `namespace` set); hosted tools (web search, ...) are dropped since
  the policy cannot run them. `tool_choice`, `max_output_tokens`, `temperature`, `top_p`.

The proxy stores no responses: `previous_response_id` is refused (send the whole
conversation, as Codex does with `store: false`). `response_body` / `stream_events` answer
with a `response` object — output items `message` (one `output_text` part) and
`function_call`; status `incomplete` with reason `max_output_tokens` when the output was cut
— and with the API's event sequence (`response.created`, `response.in_progress`, per item
`response.output_item.added`, content part / `response.output_text.delta` / `.done` or
`response.function_call_arguments.delta` / `.done`, `response.output_item.done`, then
`response.completed` or `response.incomplete`), each with an `event:` line and a
`sequence_number`. Errors use OpenAI's error shape (`gyre.proxy.errors.openai_error_body`).
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
from gyre.proxy.openai_api import tool_mode

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("system", "developer", "user", "assistant")


def parse_request(body: Any) -> CallRequest:
    """Validate a Responses API body; raises ApiError (400) naming the field."""
    check_type(body, dict, "body")
    model = need(body, "model", str, "body")
    if body.get("previous_response_id") is not None:
        raise invalid(
            "body.previous_response_id: not supported: this proxy stores no responses; "
            "send the whole conversation in `input` (store: false)",
            "previous_response_id",
        )
    _check_text_format(body)
    tools, namespaces = _tools(body)
    system = opt(body, "instructions", str, "body")
    conv = _conversation(_input_items(body), tools, system, namespaces)
    top_p = nucleus(body, "body")
    return CallRequest(
        api="responses",
        model=model,
        conversation=conv,
        max_tokens=positive_int(body, "max_output_tokens", "body", required=False),
        temperature=number_in(body, "temperature", 0.0, 2.0, "body"),
        top_p=top_p,
        stream=bool(opt(body, "stream", bool, "body")),
        tool_choice=_tool_choice(body.get("tool_choice"), conv, namespaces),
        namespaces=namespaces,
    )


def _input_items(body: dict[str, Any]) -> list[Any]:
    if "input" not in body:
        raise invalid("body.input: required field is missing", "input")
    value = body["input"]
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = check_type(value, list, "body.input")
    if not items:
        raise invalid("body.input: must contain at least one item", "input")
    return items


def _check_text_format(body: dict[str, Any]) -> None:
    text = opt(body, "text", dict, "body") or {}
    fmt = opt(text, "format", dict, "body.text") or {}
    kind = fmt.get("type", "text")
    if kind != "text":
        raise invalid(f"body.text.format.type: {kind!r} is not supported; allowed: 'text'", "text")


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    out: list[dict[str, Any]] = []
    namespaces: dict[str, tuple[str, str]] = {}
    seen: set[str] = set()
    for i, tool in enumerate(opt(body, "tools", list, "body") or []):
        where = f"body.tools[{i}]"
        check_type(tool, dict, where)
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, where, None, seen))
        elif kind == "namespace":
            ns = check_tool_name(need(tool, "name", str, where), f"{where}.name")
            for j, inner in enumerate(need(tool, "tools", list, where)):
                w = f"{where}.tools[{j}]"
                check_type(inner, dict, w)
                if inner.get("type", "function") == "function":
                    fn = _function(inner, w, ns, seen)
                    namespaces[fn["function"]["name"]] = (ns, inner["name"])
                    out.append(fn)
        # other types are hosted tools (web_search, file_search, ...): nothing to call
    return out, namespaces


def _function(
    tool: dict[str, Any], where: str, namespace: str | None, seen: set[str]
) -> dict[str, Any]:
    name = check_tool_name(need(tool, "name", str, where), f"{where}.name")
    full = f"{namespace}.{name}" if namespace else name
    if full in seen:
        raise invalid(f"{where}.name: duplicate tool name {full!r}", "tools")
    seen.add(full)
    fn: dict[str, Any] = {"name": full}
    description = opt(tool, "description", str, where)
    if description is not None:
        fn["description"] = description
    params = opt(tool, "parameters", dict, where)
    fn["parameters"] = check_schema(params, f"{where}.parameters") if params else {"type": "object"}
    return {"type": "function", "function": fn}


def _tool_choice(
    value: Any, conv: Conversation, namespaces: dict[str, tuple[str, str]]
) -> ToolChoice:
    mode = tool_mode(value, conv)
    if mode is not None:
        return mode
    if isinstance(value, dict) and value.get("type") == "function":
        name = need(value, "name", str, "body.tool_choice")
        if value.get("namespace"):
            name = f"{value['namespace']}.{name}"
        return named_choice(conv, name, "body.tool_choice.name")
    raise invalid(
        "body.tool_choice: allowed 'auto', 'none', 'required' or "
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def _conversation(
    items: list[Any],
    tools: list[dict[str, Any]],
    instructions: str | None,
    namespaces: dict[str, tuple[str, str]],
) -> Conversation:
    system = [instructions] if instructions else []
    messages: list[Message] = []
    replying = False  # the last item belongs to an assistant reply (calls may join it)
    for i, item in enumerate(items):
        where = f"body.input[{i}]"
        check_type(item, dict, where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue
        if kind == "message":
            msg = _message(item, where)
            if msg.role == "system" and not messages:
                system.append(msg.content)
            else:
                messages.append(msg)
            replying = msg.role == "assistant"
        elif kind == "function_call":
            call = _function_call(item, where)
            if not replying:
                messages.append(Message(role="assistant", content=""))
            messages[-1].tool_calls.append(call)
            replying = True
        elif kind == "function_call_output":
            call_id = need(item, "call_id", str, where)
            text = _text(item.get("output"), f"{where}.output")
            messages.append(Message(role="tool", content=text, tool_call_id=call_id))
            replying = False
        else:
            raise invalid(f"{where}.type: {kind!r}; allowed: {', '.join(ITEM_TYPES)}", "input")
    if not messages:
        raise invalid("body.input: needs at least one message besides system ones", "input")
    return Conversation(
        system="\n\n".join(system) if system else None, tools=tools, messages=messages
    )


def _message(item: dict[str, Any], where: str) -> Message:
    role = need(item, "role", str, where)
    if role not in ROLES:
        raise invalid(f"{where}.role: {role!r}; allowed: {', '.join(ROLES)}", "input")
    if "content" not in item:
        raise invalid(f"{where}.content: required field is missing", f"{where}.content")
    text = _text(item["content"], f"{where}.content")
    if role in ("system", "developer"):
        return Message(role="system", content=text)
    return Message(role=role, content=text)  # type: ignore[arg-type]


def _function_call(item: dict[str, Any], where: str) -> ToolCall:
    name = need(item, "name", str, where)
    namespace = opt(item, "namespace", str, where)
    args = arguments_text(item.get("arguments", "{}"), f"{where}.arguments")
    call_id = need(item, "call_id", str, where)
    return ToolCall(id=call_id, name=f"{namespace}.{name}" if namespace else name, arguments=args)


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of content parts (media become a placeholder)."""
    if isinstance(content, str):
        return content
    parts = check_type(content, list, where)
    out = []
    for w, part, kind in typed_items(parts, where):
        if kind in TEXT_PARTS:
            out.append(need(part, "text", str, w))
        elif kind == "refusal":
            out.append(need(part, "refusal", str, w))
        elif kind in MEDIA_PARTS:
            out.append(f"[{kind.removeprefix('input_')} omitted]")
        else:
            allowed = ", ".join((*TEXT_PARTS, "refusal", *MEDIA_PARTS))
            raise invalid(f"{w}.type: {kind!r}; allowed: {allowed}", where)
    return "".join(out)


# -- responses ------------------------------------------------------------------------------


def _suffix(reply: Reply) -> str:
    return reply.id.removeprefix("resp_")


def _message_item(reply: Reply) -> dict[str, Any]:
    part = {"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}
    return {
        "id": f"msg_{_suffix(reply)}",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }


def _call_item(reply: Reply, i: int, call: ToolCall, req: CallRequest) -> dict[str, Any]:
    item = {
        "id": f"fc_{_suffix(reply)}_{i}",
        "type": "function_call",
        "status": "completed",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }
    if call.name in req.namespaces:
        item["namespace"], item["name"] = req.namespaces[call.name]
    return item


def output_items(reply: Reply, req: CallRequest) -> list[dict[str, Any]]:
    """The reply's output items: its text as one message (unless it only calls tools), then
    one function_call per call."""
    items = [_message_item(reply)] if reply.content or not reply.tool_calls else []
    return items + [_call_item(reply, i, c, req) for i, c in enumerate(reply.tool_calls)]


def _usage(reply: Reply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _response(reply: Reply, req: CallRequest, *, done: bool) -> dict[str, Any]:
    cut = reply.finish == "length"
    status = ("incomplete" if cut else "completed") if done else "in_progress"
    return {
        "id": reply.id,
        "object": "response",
        "created_at": reply.created,
        "status": status,
        "model": reply.model,
        "output": output_items(reply, req) if done else [],
        "usage": _usage(reply) if done else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if done and cut else None,
        "instructions": None,
        "max_output_tokens": req.max_tokens,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "metadata": {},
    }


def response_body(reply: Reply, req: CallRequest) -> dict[str, Any]:
    """The non-streaming response object."""
    return _response(reply, req, done=True)


def stream_events(reply: Reply, req: CallRequest, *, piece: int = 64) -> Iterator[str]:
    """SSE events for a finished reply, ending in response.completed / response.incomplete."""
    seq = iter(range(1 << 30))

    def event(name: str, data: dict[str, Any]) -> str:
        body = {"type": name, "sequence_number": next(seq), **data}
        return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield event("response.created", {"response": _response(reply, req, done=False)})
    yield event("response.in_progress", {"response": _response(reply, req, done=False)})
    for index, item in enumerate(output_items(reply, req)):
        if item["type"] == "message":
            yield from _message_events(event, index, item, piece)
        else:
            yield from _call_events(event, index, item, piece)
    final = _response(reply, req, done=True)
    name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(name, {"response": final})


def _message_events(event: Any, index: int, item: dict[str, Any], piece: int) -> Iterator[str]:
    text = item["content"][0]["text"]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    start = {**item, "status": "in_progress", "content": []}
    yield event("response.output_item.added", {"output_index": index, "item": start})
    yield event("response.content_part.added", {**where, "part": empty})
    for s in range(0, len(text), piece):
        yield event(
            "response.output_text.delta", {**where, "delta": text[s : s + piece], "logprobs": []}
        )
    yield event("response.output_text.done", {**where, "text": text, "logprobs": []})
    yield event("response.content_part.done", {**where, "part": item["content"][0]})
    yield event("response.output_item.done", {"output_index": index, "item": item})


def _call_events(event: Any, index: int, item: dict[str, Any], piece: int) -> Iterator[str]:
    args = item["arguments"]
    where = {"item_id": item["id"], "output_index": index}
    start = {**item, "status": "in_progress", "arguments": ""}
    yield event("response.output_item.added", {"output_index": index, "item": start})
    for s in range(0, len(args), piece):
        yield event(
            "response.function_call_arguments.delta", {**where, "delta": args[s : s + piece]}
        )
    yield event(
        "response.function_call_arguments.done", {**where, "arguments": args, "name": item["name"]}
    )
    yield event("response.output_item.done", {"output_index": index, "item": item})
