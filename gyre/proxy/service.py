"""The proxy's core: executions and keys, one model call end to end, recording.

`ProxyService` is what the HTTP handlers and the coordinator (in-process) talk to. It owns
the executions (each with its trajectory tree and payload cache), the per-execution keys,
the route table (`Router`), the TITO renderer and, optionally, the run's `TraceWriter`:
every node is journaled as it is created (`record_node`) so a crash loses nothing, and
closing an execution writes its whole tree (`close_execution`).

A call: authenticate the key -> parse (API module) -> `serve`: match + render the new input
(`Execution.prepare`), label the role, build sampling params (tool_choice -> grammar), generate
with reroute, rescore a forced call's log-probs where the engines report them masked
(`gyre.proxy.rescore`), parse tool calls, record the node, answer a `Reply`. Everything that can
refuse the request happens before the engine is called, so a refused request changes no tree.
Handlers register each call in flight in `calls`; `close` (the proxy stops) answers them
with the retryable overloaded error and refuses later calls the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from gyre.errors import ProtocolError
from gyre.proxy.config import ROLE_RE, Config, RoleRule
from gyre.proxy.conversation import CallRequest, Conversation, Reply
from gyre.proxy.errors import ApiError, invalid, shutting_down
from gyre.proxy.jsonbody import check_depth
from gyre.proxy.rescore import rescore
from gyre.proxy.routing import Router, Served
from gyre.proxy.session import Execution, render
from gyre.proxy.tito import LONG_TEXT, ChatRenderer
from gyre.proxy.toolcalls import ToolFormat, forced_call_grammar, get_format
from gyre.rollout.protocol import SamplingParams
from gyre.rollout.routed import node_rows
from gyre.trajectory.tree import Node, TrajectoryTree
from gyre.vocabulary import EVALUATOR_PROVENANCE, PROVENANCE_HEADER

log = logging.getLogger(__name__)
ID_PREFIX = {"openai": "call_", "anthropic": "toolu_", "responses": "call_"}
REPLY_PREFIX = {"openai": "chatcmpl-", "anthropic": "msg_", "responses": "resp_"}
EXECUTION_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "cookie"})  # never rule text


class Abortable(Protocol):
    """A model call in flight (an HTTP handler): `abort` answers it now and cancels it."""

    def abort(self, err: ApiError) -> None: ...


class ProxyService:
    """Executions, keys, routing and recording behind both client APIs."""

    def __init__(
        self,
        config: Config,
        renderer: ChatRenderer,
        router: Router,
        *,
        store: Any = None,
        family: str | None = None,
        clock: Callable[[], float] = time.time,
        routing_top_k: int = 0,
    ) -> None:
        self.config = config
        # > 0: the served model routes each position to this many experts, and each call's
        # node records them (routing replay, `train.routing_replay`); 0: never asked
        self.routing_top_k = routing_top_k
        self.renderer = renderer
        self.router = router
        self.store = store
        self.family = family or config.model_names[0]
        self.clock = clock
        self.tool_format = _tool_format(config, renderer)
        self.executions: dict[str, Execution] = {}
        self.forgotten: set[str] = set()  # closed, tree dropped (`forget_execution`)
        self._by_key: dict[str, Execution] = {}
        self._render_pool = ThreadPoolExecutor(config.render_threads, "gyre-proxy-render")
        self.calls: set[Abortable] = set()  # model calls in flight (registered by handlers)
        self.rescores: Counter[str] = Counter()  # constrained calls rescored, by outcome
        self.closing = False

    def close(self) -> None:
        """Stop: answer every call in flight with the retryable overloaded error (503 /
        Anthropic 529; no node is recorded for it), refuse later calls the same way, and
        stop the render threads."""
        self.closing = True
        for call in list(self.calls):
            call.abort(shutting_down())
        self.calls.clear()
        self._render_pool.shutdown(wait=False, cancel_futures=True)

    # -- executions ---------------------------------------------------------------------------

    def register_execution(
        self, execution_id: str, role: str | None = None, meta: Mapping[str, Any] | None = None
    ) -> str:
        """Open an execution; returns its key (Authorization: Bearer / x-api-key)."""
        if not isinstance(execution_id, str) or not EXECUTION_RE.fullmatch(execution_id):
            raise invalid(f"execution_id: {execution_id!r}; allowed: 1-128 of A-Za-z0-9_.:@-")
        role = role or self.config.default_role
        if not isinstance(role, str) or not ROLE_RE.fullmatch(role):
            raise invalid(f"role: {role!r}; allowed: 1-64 of A-Za-z0-9_.-")
        _check_meta(meta)
        if execution_id in self.executions or execution_id in self.forgotten:
            raise ApiError("conflict", f"execution {execution_id!r} is already registered")
        key = f"gyre-{secrets.token_urlsafe(24)}"
        ex = Execution(execution_id=execution_id, role=role, key=key, meta=dict(meta or {}))
        if self.store is not None:
            self.store.open_execution(execution_id, {"role": role, **ex.meta})
        self.executions[execution_id] = ex
        self._by_key[key] = ex
        return key

    def close_execution(
        self, execution_id: str, status: str = "completed", meta: Mapping[str, Any] | None = None
    ) -> TrajectoryTree:
        """Close an execution (its key stops working) and write its tree to the store."""
        ex = self.execution(execution_id)
        if ex.closed:
            raise ApiError("conflict", f"execution {execution_id!r} is already closed")
        if not isinstance(status, str) or not 0 < len(status) <= 256 or status == "open":
            raise invalid(f"status: {status!r:.300}; allowed: 1-256 characters other than 'open'")
        _check_meta(meta)
        ex.closed, ex.status = True, status
        ex.release()
        self._by_key.pop(ex.key, None)
        self.router.forget(execution_id)
        if self.store is not None:
            ex.written = self.store.close_execution(
                execution_id,
                ex.tree,
                status=status,
                meta={"role": ex.role, **ex.meta, **dict(meta or {})},
            )
        return ex.tree

    def forget_execution(self, execution_id: str) -> None:
        """Drop a closed execution's tree, keeping its id (no new execution may reuse it).

        For a caller that holds the tree elsewhere: a run's proxy node sent every node to the
        coordinator as it was recorded, so without this its proxy kept every tree of the run
        (up to ~1M tokens each) until the job ended.
        """
        ex = self.execution(execution_id)
        if not ex.closed:
            raise ApiError("conflict", f"execution {execution_id!r} is open: close it first")
        del self.executions[execution_id]
        self.forgotten.add(execution_id)

    def execution(self, execution_id: str) -> Execution:
        ex = self.executions.get(execution_id)
        if ex is None:
            if execution_id in self.forgotten:
                raise ApiError("not_found", f"execution {execution_id!r} is closed and its tree "
                               "is no longer held here (it is in the run's trace)")  # fmt: skip
            raise ApiError("not_found", f"execution {execution_id!r} is not registered")
        return ex

    def authenticate(self, key: str | None, execution_id: str | None = None) -> Execution:
        """The open execution a key belongs to; `execution_id` (if given) must be that one."""
        if not key:
            raise ApiError(
                "authentication",
                "missing API key: send 'Authorization: Bearer "
                "<key>' or 'x-api-key: <key>' with the key of your execution",
            )
        ex = self._by_key.get(key)
        if ex is None or not hmac.compare_digest(ex.key, key):
            raise ApiError("authentication", "invalid API key (unknown or closed execution)")
        if execution_id is not None and execution_id != ex.execution_id:
            raise ApiError(
                "permission", f"this key belongs to another execution than {execution_id!r}"
            )
        return ex

    def check_model(self, model: str) -> None:
        if model not in self.config.model_names:
            raise ApiError(
                "not_found",
                f"model {model!r} is not served here; "
                f"available: {', '.join(self.config.model_names)}",
                param="model",
            )

    # -- one call -----------------------------------------------------------------------------

    async def serve(
        self,
        ex: Execution,
        req: CallRequest,
        *,
        role: str | None = None,
        provenance: str | None = None,
        headers: str = "",
        respond: Callable[[Reply], None] | None = None,
    ) -> tuple[Reply, Node]:
        """Run one model call for `ex` and record it; ApiError before any tree change.

        `respond(reply)`, if given, is called before the node is recorded, in the same turn
        of the event loop: the harness gets its answer without waiting for the recording,
        and no request can be handled between answer and recording (the next request of
        this execution always finds the node). The node is recorded even if `respond` fails.
        `role` is the x-gyre-role header; `headers` the request's headers as `name: value`
        lines for role rules (`header_lines`).
        """
        if self.closing:
            raise shutting_down()
        self.check_model(req.model)
        if provenance not in (None, "", EVALUATOR_PROVENANCE):
            raise invalid(f"{PROVENANCE_HEADER}: {provenance!r}; allowed: {EVALUATOR_PROVENANCE!r}")
        conv = req.conversation
        found = ex.match(
            conv, self.renderer, family=self.family, evaluator=provenance == EVALUATOR_PROVENANCE
        )
        if _new_chars(conv, found.matched_messages) < LONG_TEXT:
            rendered = render(found, conv, self.renderer)
        else:  # long new input: tokenize in a worker thread (the tokenizer releases the GIL)
            loop = asyncio.get_running_loop()
            rendered = await loop.run_in_executor(
                self._render_pool, render, found, conv, self.renderer
            )
        prep = ex.assemble(found, rendered)
        label = self.role_for(role, conv, ex, headers)
        sampling = self.sampling(
            req,
            len(prep.context_ids),
            call_seed(self.config.sampling_seed, ex.execution_id, len(ex.tree) + 1),
        )
        t0 = self.clock()
        rid = f"{ex.execution_id}-{len(ex.tree) + 1}-{secrets.token_hex(4)}"
        # the routed experts of the positions before each new token: from the parent's last
        # one (this call runs it first), from 0 under the root (`Node.routed_experts`)
        before = len(prep.context_ids) - len(prep.rendered.ids)
        routed_from = max(before - 1, 0) if self.routing_top_k else None
        served = await self.router.generate(
            ex.execution_id, prep.context_ids, sampling, rid, routed_from
        )
        t1 = self.clock()
        logprobs = await self.behaviour_logprobs(served, prep.context_ids, sampling, rid)
        if ex.closed:
            raise ApiError(
                "authentication", f"execution {ex.execution_id!r} closed during the call"
            )
        res = served.result
        out_ids = list(res.output_ids)
        shown = out_ids[:-1] if out_ids and out_ids[-1] in sampling.stop_token_ids else out_ids
        out = ex.parse(
            self.renderer.decode(shown),
            res.finish_type,
            conv,
            id_prefix=ID_PREFIX[req.api],
            parse_tools=req.tool_choice.mode != "none",
            forced=sampling.ebnf is not None,
            fmt=self.tool_format,
        )
        reply = Reply(
            id=f"{REPLY_PREFIX[req.api]}{secrets.token_hex(12)}",
            model=req.model,
            content=out.content,
            tool_calls=out.tool_calls,
            finish=out.finish,  # type: ignore[arg-type]
            prompt_tokens=len(prep.context_ids),
            completion_tokens=len(out_ids),
            created=int(t1),
        )
        try:
            if respond is not None:
                respond(reply)
        finally:
            node = ex.record(
                prep,
                out,
                output_ids=out_ids,
                output_logprobs=_logprobs(logprobs, len(out_ids)),
                role=label,
                policy_version=_version(res.weight_version),
                engine_id=served.engine_id,
                t_start=t0,
                t_end=t1,
                attempts=served.attempts,
                routed_experts=self.node_routing(res.routed_experts, before == 0),
            )
            if self.store is not None:
                self.store.record_node(ex.execution_id, node)
        return reply, node

    def node_routing(self, routed: np.ndarray | None, at_root: bool) -> np.ndarray | None:
        """A node's routed experts from the engine's (`gyre.rollout.routed.node_rows`); None
        when the engine reported none, or rows of another top-k (logged: a model the run did
        not expect)."""
        if routed is None:
            return None
        try:
            return node_rows(routed, self.routing_top_k, at_root=at_root)
        except ProtocolError as e:
            log.warning("%s; not recorded", e)
            return None

    async def behaviour_logprobs(
        self, served: Served, context_ids: np.ndarray, sampling: SamplingParams, rid: str
    ) -> list[float]:
        """The log-probs to record for a served call: the engine's, except for a constrained
        call on engines that report them grammar-masked, which is rescored."""
        res = served.result
        if not (sampling.constrained and self.config.constrained_logprobs == "masked"):
            return res.output_logprobs
        if not res.output_ids:
            return res.output_logprobs
        engine = self.router.engines[served.engine_id]
        fixed = await rescore(engine, context_ids, res, f"{rid}-{served.attempts}")
        self.rescores[fixed.outcome] += 1
        return fixed.logprobs

    def role_for(
        self, header: str | None, conv: Conversation, ex: Execution, headers: str = ""
    ) -> str:
        """x-gyre-role header, else the first matching role rule, else the execution's role."""
        if header:
            if not ROLE_RE.fullmatch(header):
                raise invalid(f"x-gyre-role: {header!r}; allowed: 1-64 of A-Za-z0-9_.-")
            return header
        return rule_role(self.config.role_rules, conv, headers) or ex.role

    def sampling(
        self, req: CallRequest, context_len: int, seed: int | None = None
    ) -> SamplingParams:
        """Engine sampling params: capped max_tokens, defaults, forced-tool-call grammar, the
        call's own sampling seed (None: the engine draws one)."""
        cfg = self.config
        room = cfg.max_context_tokens - context_len
        if room < 1:
            raise invalid(
                f"prompt is too long: {context_len} tokens; this model's context "
                f"holds {cfg.max_context_tokens} tokens including the output"
            )
        choice = req.tool_choice
        grammar = None
        if choice.mode in ("required", "named"):
            grammar = forced_call_grammar(
                self.tool_format,
                req.conversation.tools,
                choice.name,
                cfg.tool_string_max,
                self._marker_token,
            )
        return SamplingParams(
            max_new_tokens=min(req.max_tokens or cfg.default_max_tokens, cfg.max_tokens_cap, room),
            temperature=cfg.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop_token_ids=[self.renderer.eos_id],
            ebnf=grammar,
            sampling_seed=seed,
        )

    def _marker_token(self, marker: str) -> int | None:
        return marker_token(self.renderer.tok, marker)


def call_seed(base: int | None, execution_id: str, call: int) -> int | None:
    """The sampling seed of call `call` (1-based) of an execution: a 63-bit hash of the run's
    base seed, the execution id and the call's index, so the same call of the same execution
    samples the same tokens from the same weights, whatever else runs beside it."""
    if base is None:
        return None
    digest = hashlib.blake2b(f"{base}:{execution_id}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def marker_token(tok: Any, marker: str) -> int | None:
    """The id of `marker` when the vocabulary holds it as one added token, else None."""
    tid = tok.convert_tokens_to_ids(marker)
    if not isinstance(tid, int) or tid not in tok.added_tokens_decoder:
        return None
    # an unknown marker maps to the unknown token (SmolLM2: <|endoftext|>, an added token)
    return tid if tok.added_tokens_decoder[tid].content == marker else None


def _check_meta(meta: Any) -> None:
    if meta is not None and not isinstance(meta, Mapping):
        raise invalid(f"meta: expected an object, got {type(meta).__name__}", "meta")
    check_depth(meta, "meta")


def _tool_format(config: Config, renderer: ChatRenderer) -> ToolFormat:
    if config.tool_format != "auto":
        return get_format(config.tool_format)
    from gyre.models import tool_format

    return get_format(tool_format(renderer.tok))


def _new_chars(conv: Conversation, matched: int) -> int:
    """Characters the call must render (root attachments include the header)."""
    n = sum(
        len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
        for m in conv.messages[matched:]
    )
    if matched == 0:
        n += len(conv.system or "") + sum(len(str(t)) for t in conv.tools)
    return n


def rule_role(rules: Sequence[RoleRule], conv: Conversation, headers: str = "") -> str | None:
    """The role of the first rule whose pattern is found in its source text, else None.

    `headers`: the request's headers as `name: value` lines, names in lower case, without
    credentials (`header_lines`)."""
    for rule in rules:
        if re.search(rule.pattern, _rule_text(conv, rule.source, headers)):
            return rule.role
    return None


def header_lines(headers: Iterable[tuple[str, str]]) -> str:
    """A request's headers as the text `headers` role rules search: `name: value` lines,
    names in lower case, credentials (authorization, x-api-key, cookie) left out."""
    lines = (f"{k.lower()}: {v}" for k, v in headers if k.lower() not in CREDENTIAL_HEADERS)
    return "\n".join(lines)


def _rule_text(conv: Conversation, source: str, headers: str) -> str:
    if source == "headers":
        return headers
    if source == "system":
        return conv.system or ""
    users = [m.content for m in conv.messages if m.role == "user"]
    if not users:
        return ""
    return users[0] if source == "first_user" else users[-1]


def _logprobs(values: list[float], n: int) -> np.ndarray:
    if len(values) == n:
        return np.asarray(values, np.float32)
    log.warning("engine returned %d log-probs for %d tokens; recording NaN", len(values), n)
    return np.full(n, np.nan, np.float32)


def _version(weight_version: str) -> int:
    digits = re.search(r"(\d+)$", weight_version or "")
    return int(digits.group(1)) if digits else 0
