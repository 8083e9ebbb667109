"""Tool calls in model output: parsing `<tool_call>` blocks and forcing calls by regex.

The chat template asks the model to answer calls as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. `parse_output` turns each
well-formed block (valid JSON object, `name` one of the request's tools, `arguments` an
object) into a call and leaves everything else, malformed blocks included, as plain text.

`forced_call_regex` builds the `sampling_params.regex` that makes the engine emit exactly
one such block (tool_choice "required" / "any" or a named tool): arguments follow the tool's
JSON schema for simple property types (string, integer, number, boolean, enum, null) and a
small generic JSON object otherwise; strings are bounded so every pattern is a finite
language the constrained decoder can always finish. Only ASCII is allowed inside generated
strings, since a byte-level vocabulary spells other characters with partial-UTF-8 tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

BLOCK_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_output(text: str, tool_names: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(remaining text stripped, [(name, arguments JSON text)]) for one model output."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    pos = 0
    for m in BLOCK_RE.finditer(text):
        call = _call(m.group(1), tool_names)
        if call is None:
            continue  # malformed: stays in the text
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def _call(inner: str, tool_names: list[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"}:
        return None
    name, args = obj.get("name"), obj.get("arguments", {})
    if name not in tool_names or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


# -- forcing a call -------------------------------------------------------------------------

_SAFE_CHARS = r"[a-zA-Z0-9 _.,:/=+-]"
_INT = r"-?(0|[1-9][0-9]{0,8})"
_NUM = _INT + r"(\.[0-9]{1,6})?"


def forced_call_regex(tools: list[dict[str, Any]], only: str | None, max_str: int) -> str:
    """Regex for one `<tool_call>` block calling `only` (or any of `tools`)."""
    alternatives = []
    for tool in tools:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        args = _object(fn.get("parameters") or {}, max_str, depth=0)
        alternatives.append(
            r'\{"name": ' + re.escape(json.dumps(fn["name"])) + r', "arguments": ' + args + r"\}"
        )
    assert alternatives, "forced_call_regex needs a tool"
    body = alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"
    return r"<tool_call>\n" + body + r"\n</tool_call>"


def _string(max_str: int) -> str:
    return '"' + _SAFE_CHARS + "{0," + str(max_str) + '}"'


def _generic_object(max_str: int) -> str:
    value = "(" + "|".join([_string(max_str), _INT, "true", "false", "null"]) + ")"
    pair = '"[a-z_]{1,12}": ' + value
    return r"\{(" + pair + "(, " + pair + "){0,3})?" + r"\}"


def _value(schema: Any, max_str: int, depth: int) -> str:
    if not isinstance(schema, dict):
        return _generic_object(max_str)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return "(" + "|".join(re.escape(json.dumps(v)) for v in enum) + ")"
    kind = schema.get("type")
    if kind == "string":
        return _string(max_str)
    if kind == "integer":
        return _INT
    if kind == "number":
        return _NUM
    if kind == "boolean":
        return "(true|false)"
    if kind == "null":
        return "null"
    if kind == "object" and depth < 2:
        return _object(schema, max_str, depth + 1)
    if kind == "array" and depth < 2:
        item = _value(schema.get("items"), max_str, depth + 1)
        return r"\[(" + item + "(, " + item + "){0,2})?" + r"\]"
    return _generic_object(max_str)


def _object(schema: dict[str, Any], max_str: int, depth: int) -> str:
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        return (
            _generic_object(max_str) if schema.get("type") != "object" or props is None else r"\{\}"
        )
    required = schema.get("required")
    names = [n for n in props if isinstance(required, list) and n in required] or list(props)
    pairs = [re.escape(json.dumps(n)) + ": " + _value(props[n], max_str, depth) for n in names]
    return r"\{" + ", ".join(pairs) + r"\}"
