"""The SGLang native-HTTP subset Gyre speaks: request validation and response shapes.

Pure data, no torch: the server validates incoming JSON with `parse_generate` (raising
`ProtocolError` with a message naming the bad field and what is allowed, which the server
turns into HTTP 400), and the client builds request bodies from `SamplingParams` and reads
responses into `GenerateResult`. Field names are SGLang's, so the same client drives SGLang.

    body = {"input_ids": ids, "sampling_params": SamplingParams(max_new_tokens=8).to_json(),
            "return_logprob": True, "rid": "r1"}
    request = parse_generate(body, vocab_size=4096)
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import ProtocolError

SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "regex",
    "ignore_eos",
    "skip_special_tokens",
    "sampling_seed",
)
GENERATE_KEYS = ("input_ids", "sampling_params", "return_logprob", "rid", "stream")
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

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> GenerateResult:
        """Read an SGLang /generate response body; raises ProtocolError if malformed."""
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
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ProtocolError(f"malformed /generate response ({e!r}): {str(body)[:300]}") from e


def _matched(finish: dict[str, Any]) -> int | None:
    m = finish.get("matched")
    return int(m) if isinstance(m, int) and not isinstance(m, bool) else None


def parse_generate(body: Any, *, vocab_size: int) -> GenerateRequest:
    """Validate a /generate body; raise ProtocolError naming what is wrong."""
    if not isinstance(body, dict):
        raise ProtocolError("body: expected a JSON object")
    unknown = sorted(set(body) - set(GENERATE_KEYS))
    if unknown:
        raise ProtocolError(f"{unknown[0]}: unknown field; allowed: {', '.join(GENERATE_KEYS)}")
    if body.get("stream"):
        raise ProtocolError("stream: streaming is not supported by the embedded engine")
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
    return GenerateRequest(rid=rid, input_ids=ids, sampling=sampling, return_logprob=return_logprob)


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
    if raw.get("regex") is not None:
        if not isinstance(raw["regex"], str) or not raw["regex"]:
            raise ProtocolError(
                f"sampling_params.regex: {raw['regex']!r}; allowed: a non-empty string"
            )
        kw["regex"] = raw["regex"]
    try:
        return SamplingParams(**kw)
    except ProtocolError as e:
        raise ProtocolError(f"sampling_params.{e}") from None


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
