"""The embedded rollout engine: continuous batching of a transformers causal LM on CPU.

One worker thread runs the generation loop; HTTP handlers (gyre.rollout.server) only
submit requests and control operations. A loop iteration ("step") holds the step lock:

1. admit pending requests (up to `max_batch_size` running): prefill each alone, sample its
   first token, merge its KV cache into the running batch (gyre.rollout.kv);
2. one decode step for every running sequence, batched (left padding + mask + positions);
3. finished sequences (stop token, EOS, length, grammar dead end) leave the batch and their
   responses are delivered to the waiting handler.

Control operations (abort, pause, weight updates, memory release, KV pins and imports)
take the same lock through `at_boundary`, so they happen exactly at the next step boundary
(the worker starts no step while one waits). Memory release and weight updates keep
SGLang's preconditions (idle engine; inside a weight-update session): `EngineConflict`,
HTTP 409. Weights arrive by value (/update_weights_from_tensor) or by broadcast in an update
group the engine joined (/update_weights_from_distributed, gyre.rollout.update_group); both
are loaded the same way, at a step boundary. Sampling and behaviour log-probs: see
gyre.rollout.sampling; input log-probs (`logprob_start_len`, SGLang's scoring prefill) come
from the same prefill, its prefix-cache reuse capped at that position; grammar constraints
(regex, ebnf, json_schema): gyre.rollout.constrain; KV-cache migration on reroute:
gyre.rollout.kvstore (pin, read) and gyre.rollout.kvmigrate (the handoff).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gyre.errors import ConfigError, EngineError, ProtocolError
from gyre.rollout import kvstore, update_group, weights
from gyre.rollout.constrain import Constraint, GrammarCompiler
from gyre.rollout.kv import KVBatch, cache_from, cache_kwarg, output_cache
from gyre.rollout.pacing import Deliver, PacedCalls
from gyre.rollout.prefix import PrefixCache
from gyre.rollout.protocol import KV_TRANSPORTS, GenerateRequest, KVSegment, UpdateGroup
from gyre.rollout.routed import RouterTap, encode
from gyre.rollout.sampling import next_token, policy_logprobs
from gyre.schedule.devices import EnginePace

log = logging.getLogger(__name__)
GRAMMAR_LOGPROBS = ("model", "masked")


class EngineUnavailable(EngineError):
    """The engine cannot take work now (memory released, shutting down); HTTP 503."""


class EngineConflict(EngineError):
    """A control call the engine's state does not allow now (release while calls run, a
    weight update outside a weight-update session); HTTP 409."""


@dataclass(kw_only=True, slots=True)
class Config:
    """Embedded engine settings."""

    model: str = "tiny"
    # "tiny" | "smollm2-135m" | a local Hugging Face model directory
    threads: int = 1
    # torch intra-op threads of the engine process
    max_batch_size: int = 32
    # most sequences decoded together; later requests wait for a free row
    weight_version: str = "0"
    # initial weight version reported in every response
    request_log_tokens: int = 20_000_000
    # input tokens of received /generate calls GET /gyre/requests keeps (oldest dropped first)
    prefix_cache_mb: int = 512
    # memory for KV caches of finished calls reused by calls that extend them; 0 disables
    kv_transport: str = "auto"
    # how migrated KV segments move: "mooncake" (Transfer Engine, TCP), "http", or "auto"
    # (Mooncake when it is installed, else HTTP)
    kv_host: str = "127.0.0.1"
    # the address other engines reach this one's Mooncake Transfer Engine at
    pace: EnginePace | None = None
    # paced: each call is delivered at its modelled end (gyre.rollout.pacing); None: at once
    logprobs_under_grammar: str = "model"
    # test / emulation knob: the log-probs reported for constrained calls. "model": the
    # model's own (Gyre's behaviour log-probs); "masked": over the grammar-masked
    # distribution, as SGLang reports them (docs/engine.md "Behaviour log-probs"), so a CPU
    # test can reproduce that defect and the proxy's correction of it

    def __post_init__(self) -> None:
        if self.logprobs_under_grammar not in GRAMMAR_LOGPROBS:
            raise ConfigError(f"logprobs_under_grammar: {self.logprobs_under_grammar!r}; "
                              f"allowed: {', '.join(GRAMMAR_LOGPROBS)}")  # fmt: skip
        if self.kv_transport not in KV_TRANSPORTS:
            allowed = ", ".join(KV_TRANSPORTS)
            raise ConfigError(f"kv_transport: {self.kv_transport!r}; allowed: {allowed}")
        if self.threads < 1:
            raise ConfigError(f"threads: {self.threads}; allowed: an integer >= 1")
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size: {self.max_batch_size}; allowed: >= 1")
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb: {self.prefix_cache_mb}; allowed: >= 0")
        if self.request_log_tokens < 0:
            raise ConfigError(f"request_log_tokens: {self.request_log_tokens}; allowed: >= 0")


@dataclass(eq=False, slots=True)
class Sequence:
    """One /generate call inside the engine."""

    req: GenerateRequest
    deliver: Deliver
    tokens: list[int]  # context so far: input ids + output ids
    generator: torch.Generator | None
    regex: Constraint | None
    t_arrival: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    cached_tokens: int = 0
    input_logprobs: list[float] | None = None  # of input_ids[logprob_start_len + 1:], once
    routing: list[np.ndarray] = field(default_factory=list)
    # a MoE model's routed experts of the positions run so far, in order: int32 chunks
    # [positions, layers, top_k] (gyre.rollout.routed)

    def routed(self) -> np.ndarray | None:
        """The routed experts of every position run so far (None: no MoE routing seen)."""
        return np.concatenate(self.routing) if self.routing else None


class Engine:
    """A model, a request queue and the worker thread that serves them."""

    def __init__(self, config: Config, model: Any, tokenizer: Any) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.get_output_embeddings().weight.device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.eos_id: int | None = tokenizer.eos_token_id
        self._grammars = GrammarCompiler(tokenizer, self.vocab_size)
        self._cache_kwarg = cache_kwarg(model)
        self._prefix = PrefixCache(config.prefix_cache_mb << 20)
        self._tap = RouterTap.of_model(model)  # None for a dense model
        self._version = config.weight_version
        self._cond = threading.Condition()
        self._step = threading.Lock()
        self._pending: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._batch = KVBatch(self._cache_kwarg)
        self._paused = False
        self._controls = 0  # control operations waiting for the step lock
        self._updating = False  # a weight-update session is open
        self._groups: dict[str, Any] = {}  # update groups joined (gyre.rollout.update_group)
        self._stopping = False
        self._snapshot: weights.Snapshot | None = None
        self._log: collections.deque[tuple[str, np.ndarray, float]] = collections.deque()
        self._log_tokens = 0
        self._batch_sizes: collections.Counter[int] = collections.Counter()
        self.kv_layout = kvstore.KVLayout.of_model(model)
        self._kv = kvstore.KVPort(config.kv_transport, config.kv_host)
        self._thread = threading.Thread(target=self._loop, name="gyre-engine", daemon=True)
        self._paced = PacedCalls(config.pace) if config.pace is not None else None

    @classmethod
    def load(cls, config: Config) -> Engine:
        from gyre.models import check_batchable, load_model

        torch.set_num_threads(config.threads)
        model, tokenizer = load_model(config.model)
        check_batchable(config.model, model.config)  # refused at start, not on every /generate
        return cls(config, model, tokenizer)

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._kv.open_link_early()  # a required Mooncake link that cannot open stops the start
        self._thread.start()

    def stop(self) -> None:
        self.abort(None, "engine shutting down")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        if self._paced is not None:
            self._paced.stop()

    # ----- requests --------------------------------------------------------------------
    def submit(self, req: GenerateRequest, deliver: Deliver) -> None:
        """Queue a validated request; `deliver(response)` is called from the worker thread."""
        if len(req.input_ids) >= self.max_positions:
            raise ProtocolError(
                f"input_ids: {len(req.input_ids)} tokens; the model's context is "
                f"{self.max_positions} positions"
            )
        regex = None
        if req.sampling.constrained:
            regex = self._grammars.constraint(req.sampling, self._terminators(req))
        gen = None
        if req.sampling.temperature > 0:
            gen = self.generator(req.sampling.sampling_seed)
        seq = Sequence(
            req=req, deliver=deliver, tokens=list(req.input_ids), generator=gen, regex=regex
        )
        with self._cond:
            if self._snapshot is not None:
                raise EngineUnavailable("engine memory is released; call /resume_memory_occupation")
            if self._stopping:
                raise EngineUnavailable("engine is shutting down")
            self._record(req)
            if self._paced is not None:  # on the modelled engine from now on
                seq.deliver = self._paced.wrap(req.rid, seq.deliver)
            if req.sampling.max_new_tokens == 0 and req.logprob_start_len is None:
                seq.finish = {"type": "length", "length": 0}
                seq.deliver(self._response(seq))
                return
            self._pending.append(seq)
            self._cond.notify_all()

    def generator(self, seed: int | None) -> torch.Generator:
        """A sampler's generator, on the device the logits are on (`torch.multinomial`
        refuses a generator of another device); seed None draws a fresh one."""
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        return torch.Generator(device=self.device).manual_seed(seed)

    def _terminators(self, req: GenerateRequest) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device="cpu")  # host-side masks
        ids = list(req.sampling.stop_token_ids)
        if self.eos_id is not None and not req.sampling.ignore_eos:
            ids.append(self.eos_id)
        if ids:
            mask[ids] = True
        return mask

    # ----- control (called from handler threads; each waits for a step boundary) -------
    @contextlib.contextmanager
    def at_boundary(self) -> Iterator[None]:
        """Hold the step lock for a control operation, from the next step boundary on: the
        worker starts no new step while one waits (a plain lock would let the worker take it
        back step after step, holding a pause or an abort for the rest of the batch)."""
        with self._cond:
            self._controls += 1
        try:
            with self._step:
                yield
        finally:
            with self._cond:
                self._controls -= 1
                self._cond.notify_all()

    def abort(self, rid: str | None, message: str = "aborted by request") -> int:
        """Abort `rid` (None: all); returns how many calls ended. Partial output is kept."""
        with self.at_boundary(), self._cond:
            return self._abort_locked(rid, message)

    def _abort_locked(self, rid: str | None, message: str) -> int:
        hits = [s for s in self._pending if rid is None or s.req.rid == rid]
        for seq in hits:
            self._pending.remove(seq)
        rows = [s for s in self._running if rid is None or s.req.rid == rid]
        for seq in hits + rows:
            seq.finish = {"type": "abort", "message": message}
        self._retire()
        for seq in hits:
            seq.deliver(self._response(seq))
        held = self._paced.abort(rid, message) if self._paced is not None else 0
        return len(hits) + len(rows) + held

    def pause(self, mode: str) -> None:
        """Hold the loop. mode "abort" also aborts everything; "retract" drops the running
        sequences' KV caches and requeues them (re-prefilled on continue, so a weight update
        in between is seen by the whole context); "in_place" keeps them as they are."""
        with self.at_boundary(), self._cond:
            self._paused = True
            if mode == "abort":
                self._abort_locked(None, "aborted by pause_generation")
            if mode == "retract":
                for row, seq in enumerate(self._running):
                    self._keep_prefix(seq, self._batch.row_kv(row))
                self._pending.extendleft(reversed(self._running))
                self._running = []
                self._batch = KVBatch(self._cache_kwarg)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush_cache(self) -> None:
        """Drop the prefix cache (running calls keep their own KV)."""
        with self.at_boundary():
            self._prefix.clear()

    def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang takes weight updates only inside one)."""
        with self.at_boundary():
            if self._updating:
                raise EngineConflict(
                    "a weight-update session is already open; POST /end_weight_update first"
                )
            self._updating = True

    def end_weight_update(self) -> None:
        with self.at_boundary():
            if not self._updating:
                raise EngineConflict(
                    "no weight-update session is open; POST /begin_weight_update first"
                )
            self._updating = False

    def update_weights(self, named: weights.NamedTensors, version: str | None) -> str:
        with self.at_boundary():
            if not self._updating:
                raise EngineConflict(
                    "update_weights_from_tensor must run between /begin_weight_update and "
                    "/end_weight_update"
                )
            if self._snapshot is not None:
                raise EngineUnavailable("engine memory is released; resume it before updating")
            weights.load_named_tensors(self.model, named)
            self._prefix.clear()
            self._version = version if version is not None else _next_version(self._version)
            return self._version

    def join_update_group(self, group: UpdateGroup, rank_offset: int) -> None:
        """/init_weights_update_group: join the publisher's group at `rank_offset` (blocks
        until every member joined; no step lock: the model is not touched)."""
        with self._cond:
            if group.group_name in self._groups:
                raise EngineConflict(f"update group {group.group_name!r} exists; POST "
                                     "/destroy_weights_update_group first")  # fmt: skip
        pg = update_group.join(group, rank_offset)
        with self._cond:
            self._groups[group.group_name] = pg

    def leave_update_group(self, name: str) -> None:
        """/destroy_weights_update_group."""
        with self._cond:
            pg = self._groups.pop(name, None)
        if pg is None:
            raise ProtocolError(f"group_name: {name!r}: no such update group (joined: "
                                f"{sorted(self._groups)})")  # fmt: skip
        update_group.leave(pg)

    def update_weights_from_distributed(self, req: update_group.DistributedUpdate) -> str:
        """Receive `req.specs` by broadcast from the publisher (group rank 0) and load them
        like `update_weights`: inside a weight-update session, at a step boundary. Names,
        shapes and dtypes are checked before anything is received; the receive itself holds
        no lock (the publisher paused generation for the session)."""
        with self._cond:
            pg, updating = self._groups.get(req.group_name), self._updating
        if not updating:
            raise EngineConflict("update_weights_from_distributed must run between "
                                 "/begin_weight_update and /end_weight_update")  # fmt: skip
        update_group.check_specs(self.model, req.specs)
        if pg is None:
            raise ProtocolError(f"group_name: {req.group_name!r}: no such update group; POST "
                                "/init_weights_update_group first")  # fmt: skip
        return self.update_weights(update_group.receive(pg, req), req.version)

    def release_memory(self) -> None:
        """Drop the KV caches and the weights (kept in a CPU snapshot). Like SGLang, only
        when idle: no call running, and none waiting unless generation is paused (a paused
        engine's queued calls run after resume and continue)."""
        with self.at_boundary(), self._cond:
            busy = len(self._running) + (0 if self._paused else len(self._pending))
            if busy:
                raise EngineConflict(
                    f"release_memory_occupation: {busy} calls in flight; the engine must be "
                    'idle: POST /pause_generation {"mode": "abort"} (or abort them) first'
                )
            self._prefix.clear()
            self._kv.expire(everything=True)
            if self._snapshot is None:
                self._batch = KVBatch(self._cache_kwarg)
                self._snapshot = weights.offload(self.model)

    def resume_memory(self) -> None:
        with self.at_boundary(), self._cond:
            if self._snapshot is not None:
                weights.restore(self._snapshot)
                self._snapshot = None
            self._cond.notify_all()

    # ----- KV-cache migration (gyre.rollout.kvstore, gyre.rollout.kvmigrate) ------------
    def pin_kv(self, prefixes: list[str], rids: list[str], ttl_s: float) -> list[KVSegment]:
        """Pin the KV of the calls whose rid starts with one of `prefixes` or is in `rids`:
        the prompt of each running call, and the prefix-cache entries earlier calls left.
        A sequence another selected one extends is left out (the longer one serves both)."""
        with self.at_boundary():
            if self._snapshot is not None:
                raise EngineUnavailable("engine memory is released; nothing to pin")
            self._kv.expire()
            found = self._prefix.entries()
            for row, seq in enumerate(self._running):
                n = min(len(seq.req.input_ids), self._batch.row_length(row))
                ids = np.asarray(seq.req.input_ids[:n], np.int64)
                found.append((seq.req.rid, ids, self._batch.row_views(row, n)))
            return [
                self._kv.pin(*chosen, model=self.config.model, version=self._version, ttl_s=ttl_s)
                for chosen in kvstore.select(found, prefixes, rids)
            ]

    def release_kv(self, handles: list[str]) -> int:
        """Unpin segments (the destination acknowledged, or gave up); returns how many."""
        return self._kv.release(handles)

    def pinned_buffer(self, handle: str) -> np.ndarray | None:
        """The packed bytes of a live pin, or None (released or expired)."""
        return self._kv.buffer(handle)

    def receive_kv(
        self, source: str, segments: list[KVSegment], transport: str, timeout: float = 120.0
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Read each segment from `source` into the prefix cache; (imported, failed)."""
        return self._kv.receive(
            source, segments, transport, timeout, check=self._check_segment,
            insert=self._insert_segment,
        )  # fmt: skip

    def _check_segment(self, seg: KVSegment) -> None:
        """Refuse KV this engine cannot use as its own: another model or layout, other
        weights (the behaviour log-probs would change), or no memory."""
        mine, theirs = (
            self.kv_layout,
            kvstore.KVLayout(seg.layers, seg.heads, seg.head_dim, seg.dtype),
        )
        if seg.model != self.config.model or theirs != mine:
            raise EngineError(
                f"KV of {seg.model!r} {theirs} cannot serve {self.config.model!r} {mine}"
            )
        if seg.weight_version != self._version:
            raise EngineError(
                f"KV computed with weight_version {seg.weight_version!r}; this engine serves "
                f"{self._version!r}"
            )
        if self._snapshot is not None:
            raise EngineUnavailable("engine memory is released")

    def _insert_segment(self, seg: KVSegment, tokens: np.ndarray, layers: kvstore.LayerKV) -> None:
        with self.at_boundary():
            self._check_segment(seg)  # the version may have changed during the read
            if not self._prefix.insert(tokens, layers, seg.rid):
                raise EngineError(
                    f"KV segment of {seg.tokens} tokens ({seg.nbytes} B) does not fit the "
                    f"prefix cache ({self._prefix.capacity_bytes} B)"
                )

    # ----- introspection ----------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def released(self) -> bool:
        return self._snapshot is not None

    def _record(self, req: GenerateRequest) -> None:
        """Log a received call (cond held); the oldest go once the token budget is spent."""
        ids = np.asarray(req.input_ids, dtype=np.int32)
        self._log.append((req.rid, ids, time.time()))
        self._log_tokens += len(ids)
        while self._log and self._log_tokens > self.config.request_log_tokens:
            self._log_tokens -= len(self._log.popleft()[1])

    def request_log(self, clear: bool = False) -> list[dict[str, Any]]:
        """Received /generate calls, oldest first: {"rid", "input_ids", "t"}."""
        with self._cond:
            entries = list(self._log)
            if clear:
                self._log.clear()
                self._log_tokens = 0
        return [{"rid": r, "input_ids": ids.tolist(), "t": t} for r, ids, t in entries]

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "running": len(self._running),
                "pending": len(self._pending),
                "paused": self._paused,
                "released": self._snapshot is not None,
                "decode_steps_by_batch_size": {
                    str(k): v for k, v in sorted(self._batch_sizes.items())
                },
                "max_batch_size_seen": max(self._batch_sizes, default=0),
                "prefix_cache": {
                    "entries": len(self._prefix),
                    "bytes": self._prefix.nbytes,
                    "hits": self._prefix.hits,
                    "tokens_reused": self._prefix.tokens_reused,
                },
                "kv_migration": self._kv.stats(),
                "weight_version": self._version,
                "pace": self._paced.snapshot() if self._paced is not None else None,
            }

    # ----- the generation loop ------------------------------------------------------------
    def _ready(self) -> bool:
        idle = self._paused or self._controls or self._snapshot is not None
        return not idle and bool(self._pending or self._running)

    def _loop(self) -> None:
        torch.set_num_threads(self.config.threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stopping and not self._ready():
                        self._cond.wait()
                    if self._stopping:
                        return
                with self._step:
                    try:
                        self._step_once()
                    except Exception as e:
                        log.exception("engine step failed")
                        self._fail_all(f"engine error: {type(e).__name__}: {e}")

    def _step_once(self) -> None:
        with self._cond:
            if not self._ready():
                return
            free = self.config.max_batch_size - len(self._running)
            admitted = [self._pending.popleft() for _ in range(min(free, len(self._pending)))]
        for seq in admitted:
            self._prefill(seq)
        if self._running:
            self._decode()
        with self._cond:
            self._retire()

    def _prefill(self, seq: Sequence) -> None:
        """Prefill the tokens after the longest cached prefix and sample the first token; a
        call asking for input log-probs from `start` on reuses at most `start` tokens (as
        SGLang) and gets them from this same forward pass (once: not after a retract)."""
        start = seq.req.logprob_start_len if seq.input_logprobs is None else None
        limit = len(seq.tokens) - 1 if start is None else start
        reused, layers, cached_routing = self._prefix.lookup(seq.tokens[: limit + 1])
        kwargs: dict[str, Any] = {}
        if layers is not None:
            kwargs[self._cache_kwarg] = cache_from(layers)
        ids = torch.tensor([seq.tokens[reused:]], dtype=torch.long)
        positions = torch.arange(reused, len(seq.tokens)).unsqueeze(0)
        keep = 1 if start is None else len(seq.tokens) - start
        out = self.model(
            input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=keep, **kwargs
        )
        if start is not None:
            seq.input_logprobs = policy_logprobs(out.logits[0, :-1], seq.tokens[start + 1 :])
        if self._tap is not None:
            ran = self._tap.take(rows=1)[0]
            if cached_routing is None:  # KV migrated from another engine: routing unknown
                cached_routing = np.full((reused, *ran.shape[1:]), -1, np.int32)
            seq.routing = [cached_routing, ran]
        seq.cached_tokens = reused
        self._running.append(seq)
        self._batch.add(output_cache(out), len(seq.tokens))
        if seq.req.sampling.max_new_tokens == 0:  # a scoring prefill: nothing to generate
            seq.finish = {"type": "length", "length": 0}
            return
        self._sample(seq, out.logits[0, -1])

    def _decode(self) -> None:
        with self._cond:
            self._retire()
        if not self._running:
            return
        self._batch_sizes[len(self._running)] += 1
        inputs = self._batch.step_inputs([s.tokens[-1] for s in self._running])
        logits = self.model(**inputs).logits[:, -1]
        ran = self._tap.take(rows=len(self._running)) if self._tap is not None else None
        for row, seq in enumerate(self._running):
            if ran is not None:
                seq.routing.append(ran[row])
            self._sample(seq, logits[row])

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        sp = seq.req.sampling
        allowed = seq.regex.allowed() if seq.regex is not None else None
        if allowed is not None and not bool(allowed.any()):
            seq.finish = {"type": "stop", "matched": None, "message": "regex allows no next token"}
            return
        token, logprob = next_token(
            logits,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            allowed=allowed,
            generator=seq.generator,
            masked_logprob=self.config.logprobs_under_grammar == "masked",
        )
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        seq.tokens.append(token)
        if seq.regex is not None:
            seq.regex.advance(token)
        if token in sp.stop_token_ids or (token == self.eos_id and not sp.ignore_eos):
            seq.finish = {"type": "stop", "matched": token}
        elif len(seq.output_ids) >= sp.max_new_tokens or len(seq.tokens) >= self.max_positions:
            seq.finish = {"type": "length", "length": len(seq.output_ids)}

    def _retire(self) -> None:
        """Drop finished rows from the batch and deliver their responses (cond held)."""
        rows = [i for i, s in enumerate(self._running) if s.finish is None]
        if len(rows) == len(self._running):
            return
        done = [s for s in self._running if s.finish is not None]
        if self._prefix.capacity_bytes:
            for i, seq in enumerate(self._running):
                if seq.finish is not None:
                    self._keep_prefix(seq, self._batch.row_kv(i))
        self._running = [self._running[i] for i in rows]
        self._batch.keep(rows)
        for seq in done:
            seq.deliver(self._response(seq))

    def _keep_prefix(self, seq: Sequence, layers: kvstore.LayerKV) -> None:
        """Keep a sequence's KV of its fed tokens (all but a final sample) for later calls,
        with their routed experts."""
        fed = layers[0][0].shape[2]
        routing = seq.routed()
        kept = routing[:fed] if routing is not None and len(routing) >= fed else None
        self._prefix.insert(seq.tokens[:fed], layers, seq.req.rid, kept)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            for seq in [*self._running, *self._pending]:
                seq.finish = {"type": "abort", "message": message}
                seq.deliver(self._response(seq))
            self._running, self._batch = [], KVBatch(self._cache_kwarg)
            self._pending.clear()

    def _response(self, seq: Sequence) -> dict[str, Any]:
        """SGLang's /generate response body."""
        skip = seq.req.sampling.skip_special_tokens
        meta: dict[str, Any] = {
            "id": seq.req.rid,
            "finish_reason": seq.finish,
            "prompt_tokens": len(seq.req.input_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": seq.cached_tokens,
            "weight_version": self._version,
            "e2e_latency": time.time() - seq.t_arrival,
        }
        routing = seq.routed()
        if seq.req.return_routed_experts and routing is not None:
            ran = len(seq.tokens) - 1  # every position but the last sampled token's
            if len(routing) >= ran:  # not for a call aborted before its prefill
                meta["routed_experts"] = encode(routing[seq.req.routed_experts_start_len : ran])
        if seq.req.return_logprob:
            meta["input_token_logprobs"] = _input_logprobs(seq)
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(seq.logprobs, seq.output_ids)
            ]
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=skip)
        return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}


def _input_logprobs(seq: Sequence) -> list[list[Any]]:
    """SGLang 0.5.21's `input_token_logprobs`: [log-prob, token id, None] for each input token
    from `logprob_start_len` on, the first log-prob None (none by default)."""
    start = seq.req.logprob_start_len
    if start is None:
        return []
    values: list[float | None] = [None, *(seq.input_logprobs or [])]
    return [[lp, t, None] for lp, t in zip(values, seq.req.input_ids[start:])]


def _next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"
