"""The engine's OpenAI-compatible `/v1/chat/completions` route (the subset a judge uses).

SGLang serves OpenAI's chat-completions API beside its native routes, with `response_format`
turned into its grammar backend's `json_schema` constraint; the embedded engine serves the
same subset over `Engine`, so a judge engine (`gyre.tasks.judge`) or any
OpenAI-compatible endpoint is addressed by one client, the `openai` SDK:

    POST /v1/chat/completions
    {"model": "...", "messages": [{"role": "system" | "user" | "assistant", "content": "..."}],
     "max_tokens": 256, "temperature": 0.0, "top_p": 1.0, "seed": 7,
     "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {...}}}}

JSON output is compact (`COMPACT`). `response_format` may also be `{"type": "json_object"}` (any JSON object) or `{"type":
"text"}`. The prompt is the model's chat template with the generation prompt; the answer is
a `chat.completion` object whose `finish_reason` is "stop" or "length". Streaming, tools and
`n` > 1 are refused with a `ProtocolError` naming the field (HTTP 400).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gyre.errors import ProtocolError
from gyre.rollout.protocol import GenerateRequest, SamplingParams, request_body

CHAT_KEYS = (
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "response_format", "stream", "n",
)  # fmt: skip
ROLES = ("system", "user", "assistant")
COMPACT = {"whitespace_flexible": False}
"""llguidance's JSON options for `response_format`: no whitespace between tokens (as SGLang's
`--constrained-json-disable-any-whitespace`), so a model cannot pad a verdict with blanks
until its token limit; a schema's own `x-guidance` replaces it."""


def parse_chat(body: Any, tokenizer: Any) -> GenerateRequest:
    """A /v1/chat/completions body as the engine's generate request; ProtocolError naming
    the field that is wrong and what is allowed."""
    body = request_body(body, CHAT_KEYS, "unsupported field")
    if body.get("n", 1) != 1:
        raise ProtocolError(f"n: {body['n']!r}; allowed: 1")
    messages = _messages(body.get("messages"))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    sampling: dict[str, Any] = {"json_schema": _schema(body.get("response_format"))}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    for key, value in (("max_new_tokens", limit), ("temperature", body.get("temperature")),
                       ("top_p", body.get("top_p")), ("sampling_seed", body.get("seed"))):  # fmt: skip
        if value is not None:
            sampling[key] = value
    try:
        params = SamplingParams(**sampling)
    except (TypeError, ProtocolError) as e:
        raise ProtocolError(f"sampling: {e}") from None
    return GenerateRequest(
        rid=f"chatcmpl-{uuid.uuid4().hex}", input_ids=list(ids), sampling=params,
        return_logprob=False,
    )  # fmt: skip


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("messages: expected a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ProtocolError(f"messages[{i}].role: {role!r}; allowed: {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # text parts
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                raise ProtocolError(f"messages[{i}].content: allowed: a string or text parts")
            content = "".join(parts)  # type: ignore[arg-type]
        if not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content: allowed: a string or text parts")
        out.append({"role": role, "content": content})
    return out


def _schema(raw: Any) -> str | None:
    """The `json_schema` constraint text of a `response_format` (None: free text)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"x-guidance": COMPACT, "type": "object"})
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ProtocolError("response_format.json_schema.schema: expected a JSON object")
        return json.dumps({"x-guidance": COMPACT, **schema})
    raise ProtocolError(f"response_format.type: {kind!r}; allowed: text, json_object, json_schema")


def completion_body(result: dict[str, Any], model: str) -> dict[str, Any]:
    """The `chat.completion` answer of an engine's /generate-shaped result."""
    meta = result["meta_info"]
    finish = meta["finish_reason"] or {}
    if finish.get("type") == "abort":
        from gyre.rollout.engine import EngineUnavailable

        raise EngineUnavailable(f"generation aborted: {finish.get('message', '')}")
    reason = "length" if finish.get("type") == "length" else "stop"
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "id": meta["id"], "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": result["text"]},
            "finish_reason": reason, "logprobs": None,
        }],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion},
    }  # fmt: skip
