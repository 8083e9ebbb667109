"""Strict JSON for everything a client sends: one decoder for every route's body.

Python's `json` accepts more than JSON: `NaN`, `Infinity` and `-Infinity`, and numbers that
overflow a double (`1e400` becomes `inf`). It also lets lone UTF-16 surrogates into strings
(`"\\ud800"`: an escape JSON's grammar allows but that no UTF-8 text can hold), where they
break every later encode — the tokenizer, match hashing, the trace store, the reply. So every
request body (the three model APIs and the admin routes) and every JSON text inside one
(tool-call arguments) is decoded here:

* bytes that are not UTF-8, text that is not JSON, `NaN` / `Infinity`, a number beyond a
  double's range: `ApiError` 400 naming what was wrong;
* a lone surrogate anywhere, in values and in keys, becomes U+FFFD (a documented coercion:
  the same text always decodes to the same string, so TITO matching of later turns is
  stable; JavaScript's `JSON.stringify` writes such escapes when a harness cuts a string
  inside a surrogate pair, and a 400 would fail every later turn of that execution);
* `check_depth` bounds the nesting of free-form JSON that the proxy walks (tool schemas,
  tool-call arguments, admin `meta`) to `MAX_DEPTH` levels, so no later recursion over it
  (canonical JSON, the chat template, the forced-call grammar) can overflow the stack.

    body = decode_body(raw_bytes)            # any JSON value; ApiError (400) if bad
    args = decode_json(text, "arguments")    # JSON text inside a request
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gyre.proxy.errors import invalid

MAX_DEPTH = 100  # nesting levels of free-form JSON (schemas, arguments, meta)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPES = (b"\\ud", b"\\uD")  # how a surrogate can enter a JSON text (as an escape only)


class _Refused(ValueError):
    """A JSON value Python would accept and JSON does not."""


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} is beyond the range of a double")
    return value


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_finite)


def decode_body(raw: bytes, where: str = "body") -> Any:
    """A request body (UTF-8 JSON) as a Python value; ApiError 400 if it is not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    value = decode_json(text, where)
    if any(escape in raw for escape in _ESCAPES):
        value = without_surrogates(value)
    return value


def decode_json(text: str, where: str) -> Any:
    """One JSON text; NaN / Infinity / overflowing numbers and bad JSON: ApiError 400.

    Lone surrogates are left in place; `decode_body` (or `without_surrogates`) replaces them.
    """
    try:
        return _DECODER.decode(text)
    except _Refused as e:
        raise invalid(f"{where}: not valid JSON ({e})") from None
    except (ValueError, RecursionError) as e:
        raise invalid(f"{where}: malformed JSON ({_short(e)})") from None


def has_surrogates(text: str) -> bool:
    return _LONE_SURROGATE.search(text) is not None


def without_surrogates(value: Any) -> Any:
    """`value` with every lone surrogate in its strings (keys too) replaced by U+FFFD.

    Iterative (a decoded body may be nested ~1000 levels, beyond Python's recursion)."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                if isinstance(item, str):
                    node[i] = _LONE_SURROGATE.sub("\ufffd", item)
                elif isinstance(item, (list, dict)):
                    stack.append(item)
        elif isinstance(node, dict):
            if any(_LONE_SURROGATE.search(k) for k in node):
                items = list(node.items())
                node.clear()
                node.update((_LONE_SURROGATE.sub("\ufffd", k), v) for k, v in items)
            for k, item in node.items():
                if isinstance(item, str):
                    node[k] = _LONE_SURROGATE.sub("\ufffd", item)
                elif isinstance(item, (list, dict)):
                    stack.append(item)
    return value


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> Any:
    """`value` if it nests at most `limit` arrays / objects deep; else ApiError 400."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            raise invalid(f"{where}: nested deeper than {limit} levels", where)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def _short(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e)[:200]
