"""Match keys: where in an execution's trajectory tree a request continues.

A request's context is a chain: key_0 = H(model family, tools, system) and
key_k = H(key_{k-1} ‖ digest(message_k)). A node's `output_key` is the chain key after the
assistant message its call produced (text + tool calls with the proxy-assigned ids and the
recorded payload), so a later request that carries that reply continues the node.

Before digesting, `restore_payloads` replaces every assistant tool call whose id this
execution issued with the exact recorded name + arguments: clients re-serialize arguments
(other spacing, other key order) but keep ids, so the chain still matches. Digests are
blake2b over length-prefixed UTF-8 fields (no JSON encoding), so matching costs one pass
of hashing over the request's text (about 1 GB/s) and one dict lookup per message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from gyre.proxy.conversation import Conversation, Message, ToolCall

KEY_BYTES = 32


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def header_key(family: str, conv: Conversation) -> bytes:
    """key_0: the model family, the tool schemas (canonical JSON) and the system text."""
    tools = json.dumps(conv.tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    system = b"\x00" if conv.system is None else b"\x01" + conv.system.encode()
    return _h(b"gyre-key-v1", family.encode(), tools.encode(), system)


def message_digest(m: Message) -> bytes:
    """Digest of one canonical message; assistant text is compared stripped."""
    content = m.content.strip() if m.role == "assistant" else m.content
    parts = [
        m.role.encode(),
        content.encode("utf-8", "surrogatepass"),
        (m.tool_call_id or "").encode(),
    ]
    for c in m.tool_calls:
        parts += [c.id.encode(), c.name.encode(), c.arguments.encode("utf-8", "surrogatepass")]
    return _h(*parts)


def chain(key: bytes, digest: bytes) -> bytes:
    """key_k from key_{k-1} and digest(message_k) (both fixed-size, so no length prefix)."""
    return hashlib.blake2b(key + digest, digest_size=KEY_BYTES).digest()


def chain_keys(
    family: str, conv: Conversation, cache: dict[tuple[Any, ...], bytes] | None = None
) -> list[bytes]:
    """[key_0, key_1, ..., key_n] for a conversation of n messages.

    `cache` (one per execution) maps a message's fields to its digest: a message seen in an
    earlier request then costs a dict lookup (string hash + compare, several times cheaper
    than re-digesting) instead of blake2b over its text.
    """
    keys = [header_key(family, conv)]
    for m in conv.messages:
        if cache is None:
            digest = message_digest(m)
        else:
            fields = (
                m.role,
                m.content,
                m.tool_call_id,
                *((c.id, c.name, c.arguments) for c in m.tool_calls),
            )
            digest = cache.get(fields) or cache.setdefault(fields, message_digest(m))
        keys.append(chain(keys[-1], digest))
    return keys


def restore_payloads(conv: Conversation, payloads: Mapping[str, tuple[str, str]]) -> int:
    """Put the recorded (name, arguments) back on assistant tool calls with known ids.

    Returns how many calls were restored. Calls with unknown ids are left as the client
    sent them (harness-supplied content, which then matches no recorded node).
    """
    restored = 0
    for m in conv.messages:
        if m.role != "assistant":
            continue
        for i, c in enumerate(m.tool_calls):
            recorded = payloads.get(c.id)
            if recorded is not None:
                m.tool_calls[i] = ToolCall(id=c.id, name=recorded[0], arguments=recorded[1])
                restored += 1
    return restored


def reply_message(content: str, calls: list[ToolCall]) -> Message:
    """The canonical assistant message of a reply, as a client will send it back."""
    return Message(role="assistant", content=content, tool_calls=list(calls))
