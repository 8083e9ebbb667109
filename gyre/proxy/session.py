"""Per-execution TITO state: match a request, render its new input, record the call.

An `Execution` holds one trajectory tree, the key and role label of its harness, and the
tool-call payload cache (id -> recorded name + arguments). A call goes through `match`
(restore payloads, check tool results, compute chain keys, find the deepest recorded
reply), `render` (only the messages after it; no execution state, so the service may run
it in a worker thread), `assemble` (the engine's input ids), then `parse` + `record` (tool calls from the
output get ids; the node is added; payloads remembered). `prepare` = match + render +
assemble. No I/O, no clock: the service passes timestamps and writes nodes to the store.

Context ids: the engine gets `full_ids(parent) + new input ids`; `full_ids` of the last few
nodes are cached, so a linear conversation never re-walks its path.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.proxy import matching
from gyre.proxy.conversation import Conversation, Message, ToolCall, check_tool_results
from gyre.proxy.tito import ChatRenderer, Rendered
from gyre.proxy.toolcalls import HERMES, ToolFormat, parse_output
from gyre.trajectory.tree import Node, TrajectoryTree

FULL_IDS_CACHE = 4


@dataclass(slots=True)
class Match:
    """Where a request continues the tree (parent 0: nowhere, render it whole)."""

    parent_id: int
    matched_messages: int  # request messages already on the parent's path
    after_eos: bool  # the parent's output ended with the end-of-turn token
    input_key: bytes
    evaluator: bool


def render(found: Match, conv: Conversation, renderer: ChatRenderer) -> Rendered:
    """The new input tokens of a matched request. Changes no execution state, so the service
    may run it in a worker thread (the renderer's skeleton cache is its only write: see
    `ChatRenderer`)."""
    new = conv.messages[found.matched_messages :]
    flags = _evaluator_flags(new, found.evaluator)
    if found.parent_id == 0:
        return renderer.render_root(conv, flags)
    return renderer.render_continuation(new, after_eos=found.after_eos, evaluator=flags)


@dataclass(slots=True)
class Prepared:
    """A matched and rendered call, ready to be sent to an engine."""

    parent_id: int
    rendered: Rendered
    context_ids: np.ndarray  # everything the engine receives (int32)
    input_key: bytes
    matched_messages: int  # how many request messages the parent's path already holds


@dataclass(slots=True)
class Output:
    """A call's parsed output: client-facing text and tool calls with assigned ids."""

    content: str
    tool_calls: list[ToolCall]
    finish: str  # "stop" | "length" | "tool_calls"


@dataclass(eq=False)
class Execution:
    """One harness execution as the proxy sees it."""

    execution_id: str
    role: str
    key: str
    meta: dict[str, Any] = field(default_factory=dict)
    tree: TrajectoryTree = field(init=False)
    payloads: dict[str, tuple[str, str]] = field(default_factory=dict)
    digests: dict[tuple[Any, ...], bytes] = field(default_factory=dict)  # matching cache
    closed: bool = False
    status: str = ""
    written: Any = None  # the store's Future for this execution's tree (after close)
    _full: OrderedDict[int, np.ndarray] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.tree = TrajectoryTree(self.execution_id)

    # -- before the engine --------------------------------------------------------------------

    def prepare(
        self,
        conv: Conversation,
        renderer: ChatRenderer,
        *,
        family: str,
        evaluator: bool = False,
    ) -> Prepared:
        """Match `conv` against the tree and render its new part (raises ApiError if bad)."""
        found = self.match(conv, renderer, family=family, evaluator=evaluator)
        return self.assemble(found, render(found, conv, renderer))

    def match(
        self,
        conv: Conversation,
        renderer: ChatRenderer,
        *,
        family: str,
        evaluator: bool = False,
    ) -> Match:
        """Restore payloads, check tool results, find the deepest recorded reply. O(messages)."""
        matching.restore_payloads(conv, self.payloads)
        check_tool_results(conv, self.payloads)
        keys = matching.chain_keys(family, conv, self.digests)
        hit = self.tree.deepest_match(keys[1:]) if renderer.continuation_ok else None
        if hit is None:
            return Match(
                parent_id=0,
                matched_messages=0,
                after_eos=False,
                input_key=keys[-1],
                evaluator=evaluator,
            )
        index, parent = hit
        after_eos = len(parent.output_ids) > 0 and int(parent.output_ids[-1]) == renderer.eos_id
        return Match(
            parent_id=parent.node_id,
            matched_messages=index + 1,
            after_eos=after_eos,
            input_key=keys[-1],
            evaluator=evaluator,
        )

    def assemble(self, found: Match, rendered: Rendered) -> Prepared:
        """The engine's input: the parent's full ids + the new input ids."""
        if found.parent_id == 0:
            context = rendered.ids
        else:
            context = np.concatenate([self.full_ids(found.parent_id), rendered.ids])
        return Prepared(
            parent_id=found.parent_id,
            rendered=rendered,
            context_ids=context,
            input_key=found.input_key,
            matched_messages=found.matched_messages,
        )

    def release(self) -> None:
        """Drop the matching caches of a closed execution (the tree stays)."""
        self.digests.clear()
        self.payloads.clear()
        self._full.clear()

    def full_ids(self, node_id: int) -> np.ndarray:
        """Context + output of a node (cached for the most recent nodes)."""
        cached = self._full.get(node_id)
        if cached is None:
            cached = self.tree.full_ids(node_id)
            self._remember(node_id, cached)
        else:
            self._full.move_to_end(node_id)
        return cached

    def _remember(self, node_id: int, ids: np.ndarray) -> None:
        self._full[node_id] = ids
        while len(self._full) > FULL_IDS_CACHE:
            self._full.popitem(last=False)

    # -- after the engine ---------------------------------------------------------------------

    def parse(
        self,
        text: str,
        engine_finish: str,
        conv: Conversation,
        *,
        id_prefix: str,
        parse_tools: bool,
        forced: bool = False,
        fmt: ToolFormat = HERMES,
    ) -> Output:
        """Split output text into content and tool calls (new ids), map the finish reason;
        `forced`: the output was generated under the forced-call grammar."""
        if parse_tools and conv.tools:
            content, calls = parse_output(text, conv.tools, fmt, forced=forced)
        else:
            content, calls = text.strip(), []
        tool_calls = [
            ToolCall(id=f"{id_prefix}{secrets.token_hex(12)}", name=n, arguments=a)
            for n, a in calls
        ]
        finish = "tool_calls" if tool_calls else ("length" if engine_finish == "length" else "stop")
        return Output(content=content, tool_calls=tool_calls, finish=finish)

    def record(
        self,
        prep: Prepared,
        out: Output,
        *,
        output_ids: list[int],
        output_logprobs: Any,
        role: str,
        policy_version: int,
        engine_id: str,
        t_start: float,
        t_end: float,
        attempts: int,
        routed_experts: np.ndarray | None = None,
    ) -> Node:
        """Add the call's node to the tree and remember its tool-call payloads."""
        reply = matching.reply_message(out.content, out.tool_calls)
        node = self.tree.add_node(
            parent_id=prep.parent_id,
            input_ids=prep.rendered.ids,
            input_provenance=prep.rendered.provenance,
            output_ids=np.asarray(output_ids, np.int32),
            output_logprobs=np.asarray(output_logprobs, np.float32),
            role=role,
            policy_version=policy_version,
            engine_id=engine_id,
            t_start=t_start,
            t_end=t_end,
            finish_reason=out.finish,
            input_key=prep.input_key,
            output_key=matching.chain(prep.input_key, matching.message_digest(reply)),
            attempts=attempts,
            routed_experts=routed_experts,
        )
        for call in out.tool_calls:
            self.payloads[call.id] = (call.name, call.arguments)
        self._remember(node.node_id, np.concatenate([prep.context_ids, node.output_ids]))
        return node


def _evaluator_flags(msgs: list[Message], evaluator: bool) -> frozenset[int]:
    """Indices of the user messages an `x-gyre-provenance: evaluator` request carries new."""
    if not evaluator:
        return frozenset()
    return frozenset(i for i, m in enumerate(msgs) if m.role == "user")
