"""The SGLang native-HTTP subset Gyre speaks: request validation and response shapes.

Pure data, no torch: the server validates incoming JSON with `parse_generate` (raising
`ProtocolError` with a message naming the bad field and what is allowed, which the server
turns into HTTP 400), and the client builds request bodies from `SamplingParams` and reads
responses into `GenerateResult`. Field names are SGLang's, so the same client drives SGLang.

    body = {"input_ids": ids, "sampling_params": SamplingParams(max_new_tokens=8).to_json(),
            "return_logprob": True, "rid": "r1"}
    request = parse_generate(body, vocab_size=4096)

The control calls (abort, pause / continue, memory release / resume, weight updates) are
built here as `Call`s, and the sequences SGLang's preconditions require as `Procedure`s
(`release_procedure`, `resume_procedure`, `weight_update_procedure`), made by the async
`EngineClient.run`, for the proxy and coordinator as for the cell's blocking calls. So are
the weight-update group's records and bodies (`UpdateGroup`, `TensorSpec`,
`init_update_group_body`, `distributed_update_body`, `destroy_update_group_body`).

**The engine key.** In a run every engine takes one secret, SGLang's `--api-key` (the
embedded engine reads it from `GYRE_ENGINE_KEY`): each route but /health (SGLang also leaves
/ready* and /metrics open) answers 401 without `Authorization: Bearer <key>`. The run's
ranks and engines share it through their environment (`ensure_engine_key`); a harness
never gets it (its environment is built from scratch and its sandbox hides other
processes), so it cannot call an engine around its proxy route.

The Gyre-only KV-cache migration routes (/gyre/kv/*) have their shapes here too:
`KVSegment` (a pinned segment's descriptor), `parse_kv_pin`, `parse_kv_import`,
`parse_kv_release`; the handoff itself is `gyre.rollout.kvmigrate`.
"""

from __future__ import annotations

import math
import os
import secrets
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from gyre.errors import ProtocolError
from gyre.rollout import routed

if TYPE_CHECKING:
    import torch

ENGINE_KEY_ENV = "GYRE_ENGINE_KEY"
OPEN_ROUTES = ("/health", "/ready", "/metrics")  # open with a key set, as in SGLang


def engine_key() -> str | None:
    """This process's engine key (None: engines and clients run without one)."""
    return os.environ.get(ENGINE_KEY_ENV) or None


def ensure_engine_key(key: str | None = None) -> str:
    """Make `key` (default: the one already set, else a new random one) this process's engine
    key; engines it starts and clients it makes use it from now on."""
    key = key or engine_key() or secrets.token_hex(16)
    os.environ[ENGINE_KEY_ENV] = key
    return key


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorized(path: str, authorization: str | None, key: str | None) -> bool:
    """Whether a request for `path` with this Authorization header may pass."""
    if not key or path.startswith(OPEN_ROUTES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "regex",
    "ebnf",
    "json_schema",
    "ignore_eos",
    "skip_special_tokens",
    "sampling_seed",
)
GENERATE_KEYS = (
    "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream",
    "return_routed_experts", "routed_experts_start_len",
)  # fmt: skip
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Sampling parameters of one /generate call (SGLang field names)."""

    max_new_tokens: int = 128
    # most tokens to generate; the call finishes with type "length" when reached
    temperature: float = 1.0
    # 0 means greedy decoding
    top_p: float = 1.0
    # nucleus mass in (0, 1]
    top_k: int = -1
    # keep the k most likely tokens; -1 keeps all
    stop_token_ids: list[int] = field(default_factory=list)
    # extra tokens that end the call (besides the model's EOS), included in output_ids
    regex: str | None = None
    # constrain the whole output text to match this regular expression
    ebnf: str | None = None
    # constrain the output to this grammar (llguidance Lark syntax, as SGLang's llguidance backend)
    json_schema: str | None = None
    # constrain the output to a JSON instance of this schema (JSON text)
    ignore_eos: bool = False
    # keep generating past the model's EOS token
    skip_special_tokens: bool = True
    # drop special tokens from the returned "text"
    sampling_seed: int | None = None
    # seed of this call's sampler; None draws a fresh seed

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ProtocolError(f"max_new_tokens: {self.max_new_tokens}; allowed: an integer >= 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ProtocolError(f"temperature: {self.temperature}; allowed: a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ProtocolError(f"top_p: {self.top_p}; allowed: a number in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ProtocolError(f"top_k: {self.top_k}; allowed: -1 (all) or an integer >= 1")
        if sum(x is not None for x in (self.regex, self.ebnf, self.json_schema)) > 1:
            raise ProtocolError("regex / ebnf / json_schema: allowed: at most one constraint")

    @property
    def constrained(self) -> bool:
        """Whether a regex / ebnf / json_schema constraint is set."""
        return not (self.regex is None and self.ebnf is None and self.json_schema is None)

    def to_json(self) -> dict[str, Any]:
        """The `sampling_params` object of a /generate body (None fields left out)."""
        out = {k: getattr(self, k) for k in SAMPLING_KEYS}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(kw_only=True, slots=True)
class GenerateRequest:
    """A validated /generate call."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    logprob_start_len: int | None = None
    # with return_logprob: report input log-probs from this input position on (SGLang's
    # meaning, `score_body`); None (SGLang 0.5.21's -1, or the input's length): none
    return_routed_experts: bool = False
    # report the experts a mixture-of-experts model routed each position to (SGLang's
    # `meta_info.routed_experts`, gyre.rollout.routed)
    routed_experts_start_len: int = 0
    # ... for the positions from this one on (0..len(input_ids)), to the last one run


@dataclass(kw_only=True, slots=True)
class GenerateResult:
    """What one /generate call produced, as the client reports it."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    # behaviour log-probs, one per output token (empty if return_logprob was false)
    finish_type: str
    # "stop" | "length" | "abort"
    matched: int | None
    # the stop token that ended the call (finish_type "stop")
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    text: str
    message: str = ""
    # abort reason, if any
    cached_tokens: int = 0
    # prompt tokens the engine took from its prefix cache instead of prefilling
    routed_experts: np.ndarray | None = None
    # int32 [positions, layers * top_k] asked with `routed_from` (gyre.rollout.routed); None
    # when not asked, or the engine's model has no routed experts

    @classmethod
    def from_response(cls, body: dict[str, Any], routed_from: int | None = None) -> GenerateResult:
        """Read an SGLang /generate response body, with the routed experts of positions
        `routed_from`.. when given; raises ProtocolError if malformed."""
        try:
            meta = body["meta_info"]
            finish = meta.get("finish_reason") or {"type": "abort", "message": "no reason"}
            triples = meta.get("output_token_logprobs") or []
            logprobs = [float(x[0]) for x in triples]
            ids = body["output_ids"] if "output_ids" in body else [x[1] for x in triples]
            return cls(
                rid=str(meta.get("id", "")),
                output_ids=[int(t) for t in ids],
                output_logprobs=logprobs,
                finish_type=str(finish["type"]),
                matched=_matched(finish),
                prompt_tokens=int(meta["prompt_tokens"]),
                completion_tokens=int(meta["completion_tokens"]),
                weight_version=str(meta.get("weight_version", "")),
                text=str(body.get("text", "")),
                message=str(finish.get("message", "")),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                routed_experts=_routed(meta, routed_from, len(ids)),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ProtocolError(f"malformed /generate response ({e!r}): {str(body)[:300]}") from e


def _routed(meta: dict[str, Any], start: int | None, n_output: int) -> np.ndarray | None:
    """The routed experts of a response (positions `start` .. the last one run: the input
    and every output token but the last); None when not asked or not reported (a dense
    model, an aborted call)."""
    if start is None or meta.get("routed_experts") is None:
        return None
    positions = int(meta["prompt_tokens"]) + n_output - 1 - start
    return routed.decode(meta["routed_experts"], positions)


def score_body(input_ids: Any, start: int, rid: str) -> dict[str, Any]:
    """A /generate body asking for the model's own log-probs of `input_ids[start:]` given
    what precedes each: one prefill, nothing generated (`max_new_tokens` 0).

    SGLang's input log-probs come from the logits before any sampling step (no grammar mask,
    no temperature: `LogitsProcessor.forward`), and its prefix cache is matched only up to
    `logprob_start_len`, so the context before it is reused. Its `input_token_logprobs` lists
    `input_ids[logprob_start_len:]`, the first entry's log-prob None (no logits before it are
    computed); hence `logprob_start_len` is `start - 1`, and `ScoreResult` drops that entry.
    """
    if not 1 <= start < len(input_ids):
        raise ProtocolError(f"start: {start}; allowed: 1..{len(input_ids) - 1}")
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start - 1,
        "rid": rid,
    }


@dataclass(kw_only=True, slots=True)
class ScoreResult:
    """What a `score_body` call answered: the model's own log-probs of the scored tokens."""

    logprobs: list[float]
    # one per scored token, in order
    weight_version: str
    # the weights that computed them
    cached_tokens: int = 0
    # tokens the engine took from its prefix cache instead of prefilling

    @classmethod
    def from_response(cls, body: dict[str, Any], scored: Sequence[int]) -> ScoreResult:
        """Read the reply to `score_body(ids, start, rid)` with `scored = ids[start:]`;
        ProtocolError if it was aborted, malformed, or lists other tokens."""
        try:
            meta = body["meta_info"]
            finish = meta.get("finish_reason") or {"type": "abort", "message": "no reason"}
            if finish["type"] == "abort":
                raise ProtocolError(f"the scoring call was aborted: {finish.get('message', '')}")
            entries = meta["input_token_logprobs"][1:]  # the first: the token before `start`
            ids = [int(e[1]) for e in entries]
            if ids != [int(t) for t in scored]:
                raise ProtocolError(f"input_token_logprobs list tokens {ids[:8]}..., not the "
                                    f"{len(scored)} scored ones {list(scored)[:8]}...")  # fmt: skip
            return cls(
                logprobs=[float(e[0]) for e in entries],
                weight_version=str(meta.get("weight_version", "")),
                cached_tokens=int(meta.get("cached_tokens") or 0),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ProtocolError(f"malformed scoring response ({e!r}): {str(body)[:300]}") from e


def _matched(finish: dict[str, Any]) -> int | None:
    m = finish.get("matched")
    return int(m) if isinstance(m, int) and not isinstance(m, bool) else None


def request_body(body: Any, allowed: tuple[str, ...], unknown: str = "unknown field") -> dict:
    """`body` if it is a JSON object of `allowed` fields that asks for no streaming (the
    embedded engine answers whole); else ProtocolError naming the field and what is allowed."""
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise ProtocolError(f"{extra[0]}: {unknown}; allowed: {', '.join(allowed)}")
    if body.get("stream"):
        raise ProtocolError("stream: streaming is not supported by the embedded engine")
    return body


def parse_generate(body: Any, *, vocab_size: int) -> GenerateRequest:
    """Validate a /generate body; raise ProtocolError naming what is wrong."""
    body = request_body(body, GENERATE_KEYS)
    ids = _token_list(body.get("input_ids"), "input_ids", vocab_size)
    if not ids:
        raise ProtocolError("input_ids: empty; at least one token is required")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise ProtocolError(f"rid: {rid!r}; allowed: a non-empty string")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise ProtocolError(f"return_logprob: {return_logprob!r}; allowed: true or false")
    sampling = parse_sampling(body.get("sampling_params") or {}, vocab_size=vocab_size)
    start = _logprob_start(body.get("logprob_start_len"), len(ids))
    return_routed = body.get("return_routed_experts", False)
    if not isinstance(return_routed, bool):
        raise ProtocolError(f"return_routed_experts: {return_routed!r}; allowed: true or false")
    routed_start = _int(body.get("routed_experts_start_len", 0), "routed_experts_start_len")
    if not 0 <= routed_start <= len(ids):
        raise ProtocolError(
            f"routed_experts_start_len: {routed_start}; allowed: 0..{len(ids)} (the input's length)"
        )
    return GenerateRequest(
        rid=rid,
        input_ids=ids,
        sampling=sampling,
        return_logprob=return_logprob,
        logprob_start_len=start if return_logprob else None,
        return_routed_experts=return_routed,
        routed_experts_start_len=routed_start,
    )


def _logprob_start(value: Any, n_input: int) -> int | None:
    """`logprob_start_len` as SGLang 0.5.21 takes it: -1 (default) and the input's length
    report no input log-probs (None); above the length is refused."""
    if value is None or value == -1:
        return None
    start = _int(value, "logprob_start_len")
    if not 0 <= start <= n_input:
        raise ProtocolError(f"logprob_start_len: {start}; allowed: -1 or 0..{n_input}")
    return start if start < n_input else None


def parse_sampling(raw: Any, *, vocab_size: int) -> SamplingParams:
    """Validate a `sampling_params` object."""
    if not isinstance(raw, dict):
        raise ProtocolError("sampling_params: expected a JSON object")
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        allowed = ", ".join(SAMPLING_KEYS)
        raise ProtocolError(f"sampling_params.{unknown[0]}: unsupported field; allowed: {allowed}")
    kw: dict[str, Any] = {}
    for key in ("max_new_tokens", "top_k", "sampling_seed"):
        if raw.get(key) is not None:
            kw[key] = _int(raw[key], f"sampling_params.{key}")
    for key in ("temperature", "top_p"):
        if raw.get(key) is not None:
            kw[key] = _float(raw[key], f"sampling_params.{key}")
    for key in ("ignore_eos", "skip_special_tokens"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise ProtocolError(f"sampling_params.{key}: {raw[key]!r}; allowed: true or false")
            kw[key] = raw[key]
    if raw.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = _token_list(
            raw["stop_token_ids"], "sampling_params.stop_token_ids", vocab_size
        )
    for key in ("regex", "ebnf", "json_schema"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], str) or not raw[key]:
                raise ProtocolError(
                    f"sampling_params.{key}: {raw[key]!r}; allowed: a non-empty string"
                )
            kw[key] = raw[key]
    try:
        return SamplingParams(**kw)
    except ProtocolError as e:
        raise ProtocolError(f"sampling_params.{e}") from None


# ----- control routes: SGLang's request types, and the call sequences Gyre makes ---------
#
# Every control body Gyre sends is built here (the generate body is `EngineClient.generate`'s),
# the weight-update group's too (`UpdateGroup`, `TensorSpec`); tests/gpu/test_gpu_sglang_bodies.py
# checks each against SGLang's own request types. SGLang's HTTP layer ignores unknown fields,
# so a misspelt field would be silently dropped there: the field names matter.

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


@dataclass(frozen=True, slots=True)
class Call:
    """One control request: a POST route and its JSON body."""

    route: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Procedure:
    """Control calls made in order, stopping at the first failure; then the `cleanup` calls,
    always, each one even if another failed. The first error is the one raised."""

    calls: tuple[Call, ...]
    cleanup: tuple[Call, ...] = ()


def abort_call(rid: str | None) -> Call:
    """SGLang's AbortReq: one call by rid, or every call (rid None)."""
    return Call("/abort_request", {"rid": rid} if rid is not None else {"abort_all": True})


def pause_call(mode: str) -> Call:
    """SGLang's PauseGenerationReqInput."""
    if mode not in PAUSE_MODES:
        raise ProtocolError(f"mode: {mode!r}; allowed: {', '.join(PAUSE_MODES)}")
    return Call("/pause_generation", {"mode": mode})


CONTINUE = Call("/continue_generation", {})  # SGLang's ContinueGenerationReqInput
BEGIN_UPDATE = Call("/begin_weight_update", {})  # BeginWeightUpdateReqInput (selector "all")
END_UPDATE = Call("/end_weight_update", {})  # EndWeightUpdateReqInput


def memory_call(route: str, tags: Sequence[str] | None) -> Call:
    """SGLang's Release/ResumeMemoryOccupationReqInput (no tags: all memory)."""
    unknown = [t for t in tags or () if t not in MEMORY_TAGS]
    if unknown:
        raise ProtocolError(f"tags: {unknown[0]!r}; allowed: {', '.join(MEMORY_TAGS)}")
    return Call(route, {"tags": list(tags)} if tags else {})


def release_procedure(tags: Sequence[str] | None = None) -> Procedure:
    """Rollout -> training. SGLang asserts it is idle before releasing, so every call in
    flight is aborted by pausing in mode "abort" first; the engine stays paused until
    `resume_procedure`."""
    return Procedure((pause_call("abort"), memory_call("/release_memory_occupation", tags)))


def resume_procedure(tags: Sequence[str] | None = None) -> Procedure:
    """Training -> rollout: take the memory back, then let generation continue."""
    return Procedure((memory_call("/resume_memory_occupation", tags), CONTINUE))


def update_session_procedure() -> Procedure:
    """A weight update session as SGLang takes it: generation paused ("retract": running calls
    go back to the queue and are re-prefilled with the new weights; SGLang would otherwise
    wait for every call in flight to finish), a weight-update session opened (SGLang refuses
    updates outside one); the session is closed and generation continued in any case. The
    update calls go between `calls` and `cleanup` (`EngineClient.update_session`)."""
    return Procedure((pause_call("retract"), BEGIN_UPDATE), (END_UPDATE, CONTINUE))


def weight_update_procedure(update: Call) -> Procedure:
    """One update call inside an `update_session`."""
    session = update_session_procedure()
    return Procedure((*session.calls, update), session.cleanup)


DEFAULT_BUCKET_MB = 256
"""`engine.bucket_mb`'s default (`gyre.rollout.buckets`): a 0.5B bf16 model moves in 4
buckets, a tiny one in 1."""


def tensor_update_call(
    payloads: Sequence[str], version: str | None, *, load_format: str | None = None,
    flush_cache: bool = True,
) -> Call:  # fmt: skip
    """SGLang's UpdateWeightsFromTensorReqInput: one serialized payload per TP rank (Gyre
    sends `load_format` "flattened_bucket": `gyre.rollout.weights.bucket_call`)."""
    body = {
        "serialized_named_tensors": list(payloads),
        "load_format": load_format,
        "flush_cache": flush_cache,
        "weight_version": version,
    }
    return Call("/update_weights_from_tensor", body)


@dataclass(frozen=True, slots=True)
class UpdateGroup:
    """A weight-update process group: the core at rank 0, engines' ranks after it."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "gyre_weights"
    backend: str = "nccl"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What an engine must allocate to receive one broadcast tensor."""

    name: str
    dtype: str  # "bfloat16", "float32", ...
    shape: tuple[int, ...]


def tensor_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def init_update_group_body(group: UpdateGroup, rank_offset: int) -> dict[str, Any]:
    """SGLang's InitWeightsUpdateGroupReqInput."""
    return {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }


def distributed_update_body(
    specs: Sequence[TensorSpec], group_name: str, version: str, *, flush_cache: bool = True,
    load_format: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """SGLang's UpdateWeightsFromDistributedReqInput (`load_format` "flattened_bucket": the
    tensors of `specs` arrive as one broadcast flat buffer, `gyre.rollout.buckets`)."""
    body = {
        "names": [s.name for s in specs],
        "dtypes": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": version,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


def destroy_update_group_body(group_name: str) -> dict[str, Any]:
    """SGLang's DestroyWeightsUpdateGroupReqInput."""
    return {"group_name": group_name}


def parse_memory_tags(body: Any) -> tuple[str, ...]:
    """The `tags` of /release_memory_occupation or /resume_memory_occupation (() = all)."""
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    tags = body.get("tags") or []
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise ProtocolError(f"tags: {tags!r}; allowed: null or a list of {', '.join(MEMORY_TAGS)}")
    return tuple(tags)


def parse_pause_mode(body: Any) -> str:
    """The `mode` of /pause_generation (SGLang's default is "abort")."""
    mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
    if mode not in PAUSE_MODES:
        raise ProtocolError(f"mode: {mode!r}; allowed: {', '.join(PAUSE_MODES)}")
    return str(mode)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name}: {value!r}; allowed: an integer")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{name}: {value!r}; allowed: a number")
    return float(value)


def _token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise ProtocolError(f"{name}: expected a list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ProtocolError(f"{name}[{i}]: {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise ProtocolError(
                f"{name}[{i}]: token id {t} out of range; allowed: 0..{vocab_size - 1}"
            )
    return list(value)


# ----- KV-cache migration (Gyre only: /gyre/kv/*, see gyre.rollout.kvmigrate) ------------

KV_TRANSPORTS = ("auto", "mooncake", "http")


@dataclass(kw_only=True, slots=True)
class KVSegment:
    """A pinned KV segment as the source describes it: the KV cache of `tokens` positions
    of one call's context, packed into one host buffer the destination reads."""

    handle: str
    # the source's pin id (release it with /gyre/kv/release)
    selector: str
    # the rid prefix (or rid) of the /gyre/kv/pin call that matched it
    rid: str
    # the call whose context this is; the destination tags its prefix-cache entry with it
    tokens: int
    # positions held (the buffer starts with their token ids)
    nbytes: int
    # size of the packed buffer
    layers: int
    heads: int
    # KV heads per layer
    head_dim: int
    dtype: str
    # torch dtype name of keys and values ("float32", "bfloat16", ...)
    model: str
    # the source's model spec; the destination refuses another model
    weight_version: str
    # weights the KV was computed with; the destination refuses another version
    mooncake_session: str | None = None
    # "host:port" of the source's Mooncake Transfer Engine, if it registered the buffer
    mooncake_ptr: int | None = None
    # address of the registered buffer in the source process

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: Any) -> KVSegment:
        """Read a segment descriptor; ProtocolError naming the bad field."""
        if not isinstance(raw, dict):
            raise ProtocolError("segments[]: expected a JSON object")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ProtocolError(
                f"segments[].{unknown[0]}: unknown field; allowed: {', '.join(names)}"
            )
        kw: dict[str, Any] = {}
        for key in ("handle", "selector", "rid", "dtype", "model", "weight_version"):
            if not isinstance(raw.get(key), str):
                raise ProtocolError(f"segments[].{key}: {raw.get(key)!r}; allowed: a string")
            kw[key] = raw[key]
        for key in ("tokens", "nbytes", "layers", "heads", "head_dim"):
            kw[key] = _int(raw.get(key), f"segments[].{key}")
            if kw[key] < 1:
                raise ProtocolError(f"segments[].{key}: {kw[key]}; allowed: an integer >= 1")
        if raw.get("mooncake_session") is not None:
            if not isinstance(raw["mooncake_session"], str):
                raise ProtocolError("segments[].mooncake_session: allowed: a string or null")
            kw["mooncake_session"] = raw["mooncake_session"]
            kw["mooncake_ptr"] = _int(raw.get("mooncake_ptr"), "segments[].mooncake_ptr")
        return cls(**kw)


@dataclass(kw_only=True, slots=True)
class KVPinRequest:
    """A validated /gyre/kv/pin body: which calls' KV to pin, and for how long."""

    rid_prefixes: list[str]
    rids: list[str]
    ttl_s: float


@dataclass(kw_only=True, slots=True)
class KVImportRequest:
    """A validated /gyre/kv/import body: read these segments from `source` and keep them."""

    source: str
    segments: list[KVSegment]
    transport: str


def parse_kv_pin(body: Any) -> KVPinRequest:
    """Validate a /gyre/kv/pin body {"rid_prefixes": [...], "rids": [...], "ttl_s": s}."""
    body = _object(body, ("rid_prefixes", "rids", "ttl_s"))
    prefixes = _strings(body.get("rid_prefixes", []), "rid_prefixes")
    rids = _strings(body.get("rids", []), "rids")
    if not prefixes and not rids:
        raise ProtocolError("rid_prefixes / rids: both empty; name at least one call")
    ttl = _float(body.get("ttl_s", 120.0), "ttl_s")
    if not 0 < ttl <= 3600:
        raise ProtocolError(f"ttl_s: {ttl}; allowed: a number in (0, 3600]")
    return KVPinRequest(rid_prefixes=prefixes, rids=rids, ttl_s=ttl)


def parse_kv_import(body: Any) -> KVImportRequest:
    """Validate a /gyre/kv/import body {"source": URL, "segments": [...], "transport": ...}."""
    body = _object(body, ("source", "segments", "transport"))
    source = body.get("source")
    if not isinstance(source, str) or not source.startswith(("http://", "https://")):
        raise ProtocolError(f"source: {source!r}; allowed: the source engine's http:// URL")
    raw = body.get("segments")
    if not isinstance(raw, list):
        raise ProtocolError("segments: expected a list of segment descriptors")
    transport = body.get("transport") or "auto"
    if transport not in KV_TRANSPORTS:
        raise ProtocolError(f"transport: {transport!r}; allowed: {', '.join(KV_TRANSPORTS)}")
    segments = [KVSegment.from_json(s) for s in raw]
    return KVImportRequest(source=source.rstrip("/"), segments=segments, transport=transport)


def parse_kv_release(body: Any) -> list[str]:
    """The handles of a /gyre/kv/release body {"handles": [...]}."""
    return _strings(_object(body, ("handles",)).get("handles", []), "handles")


def _object(body: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    unknown = sorted(set(body) - set(keys))
    if unknown:
        raise ProtocolError(f"{unknown[0]}: unknown field; allowed: {', '.join(keys)}")
    return body


def _strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ProtocolError(f"{name}: {str(value)[:100]}; allowed: a list of non-empty strings")
    return list(value)


@dataclass(kw_only=True, slots=True)
class KVImportResult:
    """The destination's acknowledgement of a /gyre/kv/import: what it took over."""

    imported: list[dict[str, Any]]
    # {"handle", "rid", "tokens", "nbytes", "transport", "seconds"} per segment now cached
    failed: list[dict[str, Any]]
    # {"handle", "rid", "error"} per segment it could not take (it recomputes those)
