"""TITO rendering: only the new part of a request becomes new tokens, with provenance.

The chat template is the model's own (`tokenizer.apply_chat_template`, never a hand-written
copy). Two renderings exist:

* `render_root(conv)` renders a whole request (a call attached to the tree's root).
* `render_continuation(new_messages, after_eos=...)` renders only the messages that follow
  a matched node: the template is applied to a short conversation
  `[user "…", assistant SENTINEL] + new_messages` with the generation prompt, and the text
  after the sentinel is kept. If the matched node's output already ended with the
  end-of-turn token (`<|im_end|>`), the template's copy of it is dropped from the front.
  The cost is O(new content), independent of the context length. This relies on the
  template rendering a turn independently of earlier turns (true for ChatML-style
  templates; `ChatRenderer.continuation_ok` is False when a probe finds the sentinel not
  rendered verbatim, and the caller then attaches the call to the root instead).

Continuations of content-only messages (user / tool / system, no tool calls: almost every
agent turn) skip the template engine after the first time: the template is applied once
per message *shape* (the roles, and whether each message answers a tool call) with
placeholder contents, and the text around the placeholders becomes that shape's skeleton.
A shape is cached only if the template inserts content verbatim and independently of its
value: three probes (two different placeholder sets and tool-call ids, one padded with
whitespace) must all equal the skeleton filled with their contents. ChatML-style templates
pass; a template that trims, escapes or inspects content fails and is always applied. The
first render of each shape and every `VERIFY_EVERY`-th one after are also rendered by the
template and compared; a difference turns the fast path off for good (logged). The cost
of a continuation is then the tokenizer's, O(new content), with no template rendering.

Provenance is assigned per character, then per token through the tokenizer's offsets
mapping: message contents get their author's code (SYSTEM / USER / TOOL / INJECTED /
EVALUATOR), the system turn of a root render is SYSTEM, the text of harness-supplied tool
calls is INJECTED, special tokens and all other template markup are TEMPLATE. A token
spanning a boundary takes the code of its first non-TEMPLATE character.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre.errors import ConfigError
from gyre.proxy.conversation import Conversation, Message
from gyre.proxy.errors import invalid
from gyre.trajectory.tree import Provenance

log = logging.getLogger(__name__)
SENTINEL = "GYRE0SENTINEL0f3a9c"
VERIFY_EVERY = 64  # every n-th skeleton render of a shape is checked against the template
MAX_SHAPES = 256  # message shapes with a cached skeleton
Shape = tuple[tuple[str, bool], ...]  # per new message: (role, answers a tool call)
LONG_TEXT = 8192  # characters; longer new input is rendered in a worker thread
_ROLE_PROV = {
    "system": Provenance.SYSTEM,
    "user": Provenance.USER,
    "tool": Provenance.TOOL,
    "assistant": Provenance.INJECTED,
}


@dataclass(slots=True)
class Rendered:
    """New input tokens of one call, their provenance codes and the text they encode."""

    ids: np.ndarray  # int32
    provenance: np.ndarray  # uint8
    text: str


@dataclass(slots=True)
class Skeleton:
    """A shape's rendered text around its message contents: pieces[0] c0 pieces[1] c1 ..."""

    pieces: tuple[str, ...]
    uses: int = 0

    def fill(self, contents: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text, and each content's (start, end) in it."""
        parts = [self.pieces[0]]
        spans = []
        pos = len(self.pieces[0])
        for c, p in zip(contents, self.pieces[1:], strict=True):
            spans.append((pos, pos + len(c)))
            parts += (c, p)
            pos += len(c) + len(p)
        return "".join(parts), spans


def template_message(m: Message) -> dict[str, Any]:
    """The dict the chat template sees for one normalized message."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _args_obj(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _code(m: Message, i: int, evaluator: frozenset[int]) -> int:
    """Provenance of message i's content (evaluator-flagged user messages: EVALUATOR)."""
    return int(Provenance.EVALUATOR if i in evaluator and m.role == "user" else _ROLE_PROV[m.role])


def _args_obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ChatRenderer:
    """Renders normalized conversations to token ids with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("tokenizer: a fast (Rust) tokenizer is needed for offsets mapping")
        if not tokenizer.chat_template:
            raise ConfigError("tokenizer: has no chat template")
        self.tok = tokenizer
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer: ids + char offsets
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        specials.sort(key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.eos_id: int = int(tokenizer.eos_token_id)
        self.continuation_ok = self._probe()
        # Written from render threads too, without a lock: a dict insert is atomic, two
        # threads probing one shape store equal skeletons, and a lost `uses` increment only
        # shifts when the next verification happens.
        self._skeletons: dict[Shape, Skeleton | None] = {}
        self.skeletons_ok = True  # False after a verification found a difference

    # -- public -------------------------------------------------------------------------------

    def render_root(self, conv: Conversation, evaluator: frozenset[int] = frozenset()) -> Rendered:
        """The whole request (header + all messages + generation prompt)."""
        msgs = conv.messages
        head = [Message(role="system", content=conv.system)] if conv.system is not None else []
        text = self._apply(head + msgs, conv.tools)
        prov = np.full(len(text), Provenance.TEMPLATE, np.uint8)
        cursor = 0
        if conv.system is not None or conv.tools:
            end = text.find(self.tok.eos_token or "\x00")
            cursor = end if end > 0 else 0
            prov[:cursor] = Provenance.SYSTEM
        self._mark_messages(text, prov, msgs, cursor, evaluator, tools=conv.tools, head=head)
        return self._encode(text, prov)

    def render_continuation(
        self, new: list[Message], *, after_eos: bool, evaluator: frozenset[int] = frozenset()
    ) -> Rendered:
        """Only `new` (messages after a matched reply) plus the generation prompt."""
        assert self.continuation_ok
        spans = None
        skeleton = self._skeleton(new)
        if skeleton is None:
            full = self._apply(self._short(new), None)
        else:
            full, spans = skeleton.fill([m.content for m in new])
            skeleton.uses += 1
            if skeleton.uses % VERIFY_EVERY == 1:
                full, spans = self._verify(new, full, spans)
        start = full.index(SENTINEL) + len(SENTINEL)
        eos = self.tok.eos_token or ""
        if after_eos and eos and full.startswith(eos, start):
            start += len(eos)
        text = full[start:]
        prov = np.full(len(text), Provenance.TEMPLATE, np.uint8)
        if spans is None:
            self._mark_messages(text, prov, new, 0, evaluator, tools=None, head=None, offset=start)
        else:
            for i, (m, (a, b)) in enumerate(zip(new, spans, strict=True)):
                prov[a - start : b - start] = _code(m, i, evaluator)
            self._mark_specials(text, prov)
        return self._encode(text, prov)

    def decode(self, ids: list[int]) -> str:
        """Output text for the client (special tokens dropped)."""
        return str(self._backend.decode(ids, skip_special_tokens=True))

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _short(new: list[Message]) -> list[Message]:
        return [
            Message(role="user", content="."),
            Message(role="assistant", content=SENTINEL),
            *new,
        ]

    def _apply(self, msgs: list[Message], tools: list[dict[str, Any]] | None) -> str:
        try:
            text = self.tok.apply_chat_template(
                [template_message(m) for m in msgs],
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as e:  # jinja raise_exception / TemplateError: the template refuses
            raise invalid(f"messages: the model's chat template refused them: {e}") from None
        return str(text)

    def _skeleton(self, new: list[Message]) -> Skeleton | None:
        """The cached skeleton for `new`'s shape (probed on first sight), or None."""
        if not self.skeletons_ok or any(m.role == "assistant" or m.tool_calls for m in new):
            return None
        shape = tuple((m.role, m.tool_call_id is not None) for m in new)
        if shape in self._skeletons:
            return self._skeletons[shape]
        if len(self._skeletons) >= MAX_SHAPES:  # an unusual mix of shapes: no more probing
            return None
        skeleton = self._skeletons[shape] = self._probe_shape(shape)
        return skeleton

    def _probe_shape(self, shape: Shape) -> Skeleton | None:
        def probe(tag: str, pad: str) -> tuple[list[str], str]:
            contents = [f"{pad}GYRE{tag}SLOT{i}X{pad[::-1]}" for i in range(len(shape))]
            msgs = [
                Message(role=role, content=c, tool_call_id=f"gyre_{tag}_{i}" if answers else None)  # type: ignore[arg-type]
                for i, (c, (role, answers)) in enumerate(zip(contents, shape, strict=True))
            ]
            return contents, self._apply(self._short(msgs), None)

        try:
            contents, text = probe("a", "")
            rest, pieces = text, []
            for c in contents:
                if rest.count(c) != 1:
                    return None
                head, rest = rest.split(c)
                pieces.append(head)
            skeleton = Skeleton(pieces=(*pieces, rest))
            for tag, pad in (("b", ""), ("c", " \n\t")):
                contents, text = probe(tag, pad)
                if skeleton.fill(contents)[0] != text:
                    return None
        except Exception:  # the template refuses this shape: always apply it
            return None
        return skeleton

    def _verify(
        self, new: list[Message], fast: str, spans: list[tuple[int, int]]
    ) -> tuple[str, list[tuple[int, int]] | None]:
        """Compare a skeleton render with the template's; turn skeletons off on a difference."""
        slow = self._apply(self._short(new), None)
        if slow == fast:
            return fast, spans
        self.skeletons_ok = False
        log.warning(
            "chat template renders content-dependently; rendering every call with the "
            "template from now on (a continuation differed from its cached skeleton)"
        )
        return slow, None

    def _probe(self) -> bool:
        try:
            text = self._apply(self._short([Message(role="user", content="GYREPROBE")]), None)
        except Exception:
            return False
        return text.count(SENTINEL) == 1 and text.find("GYREPROBE") > text.find(SENTINEL)

    def _mark_messages(
        self,
        text: str,
        prov: np.ndarray,
        msgs: list[Message],
        cursor: int,
        evaluator: frozenset[int],
        *,
        tools: list[dict[str, Any]] | None,
        head: list[Message] | None,
        offset: int = 0,
    ) -> None:
        for i, m in enumerate(msgs):
            code = _code(m, i, evaluator)
            if m.content:
                pos = text.find(m.content, cursor)
                if pos >= 0:
                    prov[pos : pos + len(m.content)] = code
                    cursor = pos + len(m.content)
            if m.role == "assistant" and m.tool_calls:
                lo, hi = self._calls_span(msgs, i, tools, head, offset)
                prov[max(lo, cursor) : hi] = Provenance.INJECTED
                cursor = max(cursor, hi)
        self._mark_specials(text, prov)

    def _mark_specials(self, text: str, prov: np.ndarray) -> None:
        """Special-token strings are TEMPLATE wherever they appear (also inside content)."""
        if self._special_re is not None:
            for sm in self._special_re.finditer(text):
                prov[sm.start() : sm.end()] = Provenance.TEMPLATE

    def _calls_span(
        self,
        msgs: list[Message],
        i: int,
        tools: list[dict[str, Any]] | None,
        head: list[Message] | None,
        offset: int,
    ) -> tuple[int, int]:
        """Where message i's tool calls are rendered: diff against a render without them."""
        bare = list(msgs)
        bare[i] = Message(role="assistant", content=msgs[i].content)
        if head is None:
            a, b = self._apply(self._short(msgs), None), self._apply(self._short(bare), None)
        else:
            a, b = self._apply(head + msgs, tools), self._apply(head + bare, tools)
        p = 0
        while p < min(len(a), len(b)) and a[p] == b[p]:
            p += 1
        s = 0
        while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
            s += 1
        return p - offset, len(a) - s - offset

    def _encode(self, text: str, char_prov: np.ndarray) -> Rendered:
        if len(text) < LONG_TEXT:
            enc = self._backend.encode(text, add_special_tokens=False)
        else:  # encode_batch releases the GIL: long renders in worker threads don't stall the loop
            enc = self._backend.encode_batch([text], add_special_tokens=False)[0]
        ids = np.asarray(enc.ids, np.int32)
        if len(ids) == 0:
            return Rendered(ids=ids, provenance=np.zeros(0, np.uint8), text=text)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        content = np.flatnonzero(char_prov != Provenance.TEMPLATE)
        prov = np.full(len(ids), Provenance.TEMPLATE, np.uint8)
        if len(content):
            nxt = np.searchsorted(content, offsets[:, 0])
            has = nxt < len(content)
            first = np.where(has, content[np.minimum(nxt, len(content) - 1)], len(text))
            inside = has & (first < np.maximum(offsets[:, 1], offsets[:, 0] + 1))
            prov[inside] = char_prov[first[inside]]
        return Rendered(ids=ids, provenance=prov, text=text)
