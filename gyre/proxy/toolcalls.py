"""Tool calls per model family: parsing model output, and forcing a call by grammar.

A `ToolFormat` is how one model family writes tool calls; the format follows the model's
own chat template (`gyre.models.tool_format`, or the proxy's `tool_format` setting):

* `hermes` — `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5,
  Hermes, Gyre's ChatML template for models whose template renders no tools);
* `qwen3_coder` — `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>` (Qwen3-Coder's XML; values are raw text, cast by the schema);
* `llama3_json` — the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1+;
  several calls separated by `;`).

`parse_output` reads an output with transformers' response parser
(`transformers.utils.chat_parsing`, declarative per-format `response_template`s) and keeps the
calls only if every one is well formed (a request tool's name, an object of arguments):
otherwise the whole output is plain text, so a malformed call never half-parses. A forced
output (its shape fixed by the grammar below) is read as the format's one JSON call first:
the grammar lets a string argument hold the close marker (`</tool_call>`, `};`), where a text
parser would cut the call.

`forced_call_grammar` builds the engine's `sampling_params.ebnf` (llguidance Lark) for
tool_choice "required" / a named tool: exactly one call in the format, its arguments
generated from the tool's JSON schema by llguidance's `%json` (nested objects, arrays,
enums, Unicode, any depth). Objects without `additionalProperties` get `false`, strings
without `maxLength` get `max_str` and unbounded integers nine digits, so a forced call is
always finite. Markers that are single added tokens of the vocabulary (`<tool_call>` in
Qwen's) are written as `<[id]>`, the spelling the model itself emits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers.utils.chat_parsing import parse_response
from transformers.utils.chat_parsing.response_templates import (
    ResponseTemplate,
    load_response_template,
)

log = logging.getLogger(__name__)
ANCHOR = "<gyre:reply>"  # parsing starts here: the model output follows the prefix ANCHOR
FORMATS = ("hermes", "qwen3_coder", "llama3_json")
TokenId = Callable[[str], "int | None"]  # a marker's token id when it is one added token
# Marks the grammar as llguidance Lark (SGLang's llguidance backend reads `ebnf` so); it also
# selects llguidance's lexer, ~100x faster masks than plain-Lark mode on a 49k vocabulary.
LARK_HEADER = "%llguidance {}"
MAX_INT = 10**9 - 1  # integers without bounds stay within nine digits in forced calls
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one model family writes calls: a parser template and a grammar per call."""

    name: str
    response_template: dict[str, Any]
    call: Callable[[dict[str, Any], int, TokenId], str]  # Lark expression of one call
    # A forced call is exactly open + JSON object + close (its arguments under `args_key`):
    # read as one JSON document, so an argument string holding the close marker is not cut
    # where the template parser would cut it. None: the template parser is exact (XML values
    # cannot hold "</" under the forced grammar).
    envelope: tuple[str, str, str] | None = None

    def parser_template(self) -> ResponseTemplate:
        """The compiled response template (compiled once per format)."""
        hit = _COMPILED.get(self.name)
        if hit is None:
            hit = _COMPILED[self.name] = load_response_template(self.response_template)
        return hit


_COMPILED: dict[str, ResponseTemplate] = {}


def _hermes_call(fn: dict[str, Any], max_str: int, token: TokenId) -> str:
    schema = _call_schema(fn, "arguments", max_str)
    open_, close = _lit("<tool_call>", token), _lit("</tool_call>", token)
    return f'{open_} "\\n" %json {json.dumps(schema)} "\\n" {close}'


def _llama_call(fn: dict[str, Any], max_str: int, token: TokenId) -> str:
    return f"%json {json.dumps(_call_schema(fn, 'parameters', max_str))}"


def _xml_call(fn: dict[str, Any], max_str: int, token: TokenId) -> str:
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = [n for n in props if n in (params.get("required") or [])] or list(props)
    parts = [_lit("<tool_call>", token), json.dumps(f"\n<function={fn['name']}>\n")]
    for key in required:
        parts.append(json.dumps(f"<parameter={key}>\n"))
        parts.append(_xml_value(_bounded(props[key], max_str), max_str))
        parts.append(json.dumps("\n</parameter>\n"))
    parts += [json.dumps("</function>\n"), _lit("</tool_call>", token)]
    return " ".join(parts)


def _xml_value(schema: Any, max_str: int) -> str:
    if isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema:
        return f"/(?s:[^<]|<[^\\/]){{0,{min(schema.get('maxLength', max_str), max_str)}}}/"
    return f"%json {json.dumps({**_as_dict(schema), 'x-guidance': _JSON_STYLE})}"


JOINED_TEXT = {"content": "text", "repeats": True, "join": "\n"}  # text around the calls


def _response_template(
    open_pattern: str,
    close_pattern: str,
    call: dict[str, Any],
    text: Mapping[str, Any] = JOINED_TEXT,
) -> dict[str, Any]:
    """A reply from ANCHOR on: repeated calls between the two patterns, each read by `call`,
    and the text outside them read by `text`."""
    calls = {"open_pattern": open_pattern, "close_pattern": close_pattern, "repeats": True}
    return {
        "start_anchor": ANCHOR,
        "defaults": {"role": "assistant"},
        "fields": {"tool_calls": {**calls, **call}, "content": dict(text)},
    }


HERMES = ToolFormat(
    name="hermes",
    response_template=_response_template(
        r"\s*<tool_call>\s*",
        r"\s*</tool_call>",
        {"content": "json", "transform": {"type": "function", "function": "{content}"}},
    ),
    call=_hermes_call,
    envelope=("<tool_call>\n", "\n</tool_call>", "arguments"),
)
QWEN3_CODER = ToolFormat(
    name="qwen3_coder",
    response_template=_response_template(
        r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
        r"</function>\s*</tool_call>",
        {
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>"
            },
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": "{content}"},
            },
        },
    ),
    call=_xml_call,
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    response_template=_response_template(
        r'\s*(?=\{\s*"name")',
        r"(?<=\})\s*(?:;|$)",
        {
            "content": "json",
            "transform": {
                "type": "function",
                "function": {"name": "{content.name}", "arguments": "{content.parameters}"},
            },
        },
        text={"content": "text"},
    ),
    call=_llama_call,
    envelope=("", "", "parameters"),
)
BY_NAME = {f.name: f for f in (HERMES, QWEN3_CODER, LLAMA3_JSON)}


def get_format(name: str) -> ToolFormat:
    """The format called `name` (one of FORMATS)."""
    return BY_NAME[name]


# -- parsing --------------------------------------------------------------------------------


def parse_output(
    text: str, tools: list[dict[str, Any]], fmt: ToolFormat = HERMES, *, forced: bool = False
) -> tuple[str, list[tuple[str, str]]]:
    """(remaining text stripped, [(name, arguments JSON text)]) for one model output;
    `forced`: the output was generated under `forced_call_grammar`."""
    names = {t["function"]["name"] for t in tools}
    if forced and fmt.envelope is not None:
        call = _enveloped_call(text, fmt.envelope, names)
        if call is not None:
            return "", [call]
    try:
        message = parse_response(text, fmt.parser_template(), prefix=ANCHOR, tools=list(tools))
    except Exception as e:  # a malformed call (the parser's errors vary by format): text
        log.debug("tool-call parse failed (%r); the output stays text", e)
        return text.strip(), []
    calls: list[tuple[str, str]] = []
    for entry in message.get("tool_calls") or []:
        fn = entry.get("function") if isinstance(entry, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if isinstance(args, str):
            args = _json_object(args)
        if name not in names or not isinstance(args, dict):
            return text.strip(), []
        calls.append((str(name), json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text.strip(), []
    return str(message.get("content") or "").strip(), calls


def _enveloped_call(
    text: str, envelope: tuple[str, str, str], names: set[str]
) -> tuple[str, str] | None:
    """The one call of a complete forced output, None if it is not one (cut by max_tokens)."""
    open_, close, args_key = envelope
    if not (text.startswith(open_) and text.endswith(close)):
        return None
    obj = _json_object(text[len(open_) : len(text) - len(close)])
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key)
    if not isinstance(args, dict):
        return None
    return str(obj["name"]), json.dumps(args, ensure_ascii=False)


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# -- forcing a call -------------------------------------------------------------------------


def forced_call_grammar(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    only: str | None,
    max_str: int,
    token: TokenId = lambda marker: None,
) -> str:
    """llguidance Lark grammar for one call of `only` (or any of `tools`) in `fmt`."""
    calls = [
        fmt.call(t["function"], max_str, token)
        for t in tools
        if only is None or t["function"]["name"] == only
    ]
    assert calls, "forced_call_grammar needs a tool"
    rules = [f"call_{i}: {c}" for i, c in enumerate(calls)]
    start = "start: " + " | ".join(f"call_{i}" for i in range(len(calls)))
    return "\n".join([LARK_HEADER, start, *rules])


def _call_schema(fn: dict[str, Any], args_key: str, max_str: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": fn["name"]},
            args_key: _bounded(fn.get("parameters") or {"type": "object"}, max_str),
        },
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": {**_JSON_STYLE, "lenient": True},
    }


def _bounded(schema: Any, max_str: int) -> Any:
    """The schema with closed objects and bounded strings, wherever it does not say."""
    if isinstance(schema, list):
        return [_bounded(s, max_str) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v, max_str) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _bounded(v, max_str) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    if schema.get("type") == "string" and "enum" not in schema and "const" not in schema:
        limit = schema.get("maxLength")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            limit = max_str  # not a count (an invalid schema): the bound
        out["maxLength"] = min(limit, max_str)
    if schema.get("type") == "integer":
        out.setdefault("minimum", -MAX_INT)
        out.setdefault("maximum", MAX_INT)
    return out


def _as_dict(schema: Any) -> dict[str, Any]:
    return schema if isinstance(schema, dict) else {}


def _lit(marker: str, token: TokenId) -> str:
    """A marker as a Lark literal, or as its token when it is one added token."""
    tid = token(marker)
    return f"<[{tid}]>" if tid is not None else json.dumps(marker)
