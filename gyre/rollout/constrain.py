"""Grammar-constrained decoding on llguidance (SGLang's `regex` / `ebnf` / `json_schema`).

The proxy forces tool calls (tool_choice "required" or a named tool) by sending a grammar the
whole output must follow; SGLang's three constraint fields are accepted here with the meaning
SGLang gives them under `--grammar-backend llguidance`:

* `regex` — a regular expression the whole output matches;
* `ebnf` — an llguidance Lark grammar (the proxy's forced calls: literal markers plus `%json`
  sub-grammars built straight from the tools' JSON schemas);
* `json_schema` — a JSON schema (text) the output is an instance of.

`GrammarCompiler` wraps one engine's tokenizer for llguidance (built on first use: ~0.2 s
for the tiny vocabulary, a few seconds for 49k tokens) and validates and caches grammars;
`Constraint` follows one generation: `allowed()` is the mask of tokens that keep the output
a live prefix of the language — plus the call's terminators (EOS, `stop_token_ids`) once the
output is complete — and `advance(token)` consumes the sampled token. The mask restricts
what is *sampled* only: the behaviour log-prob the engine records stays the model's own
(`gyre.rollout.sampling.policy_logprob`).

llguidance works on token bytes, so any Unicode the vocabulary can spell is allowed (a
character split over several byte-level tokens included). Where the grammar forces a run of
bytes, llguidance allows only the first token of their canonical tokenization. Special tokens
are never produced from grammar text: a grammar names a token as `<[id]>`, which
`gyre.proxy.toolcalls` does for markers that are single added tokens (`<tool_call>` in
Qwen-style vocabularies), so the forced spelling is the one the model itself uses.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from gyre.errors import ProtocolError

if TYPE_CHECKING:
    from gyre.rollout.protocol import SamplingParams

Kind = Literal["regex", "ebnf", "json_schema"]
KINDS: tuple[Kind, ...] = ("regex", "ebnf", "json_schema")
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class Grammar:
    """One constraint as sent by a client: its SGLang field name and its text."""

    kind: Kind
    text: str

    @classmethod
    def of(cls, sampling: SamplingParams) -> Grammar | None:
        """The constraint of a call's sampling params (at most one is set), or None."""
        for kind in KINDS:
            text = getattr(sampling, kind)
            if text is not None:
                return cls(kind, text)
        return None


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ProtocolError(
            "sampling_params: constrained decoding needs the llguidance package "
            "(pip install llguidance)"
        ) from None
    return llguidance


class GrammarCompiler:
    """Validates grammars for one tokenizer and keeps the most recent ones (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, capacity: int = 64) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._capacity = capacity
        self._lltok: Any = None
        self._compiled: OrderedDict[Grammar, str] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, sampling: SamplingParams, terminators: torch.Tensor) -> Constraint | None:
        """A fresh `Constraint` for a call, or None when its sampling params set none."""
        grammar = Grammar.of(sampling)
        if grammar is None:
            return None
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer(), self.compile(grammar), log_level=1)
        if matcher.is_error():
            raise ProtocolError(f"sampling_params.{grammar.kind}: {matcher.get_error()}")
        return Constraint(matcher, terminators, eos_id=self.tokenizer().eos_token)

    def tokenizer(self) -> Any:
        """The llguidance view of the vocabulary (built once, thread-safe)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = _llguidance().LLTokenizer(
                    _plain_added_tokens(self._hf.backend_tokenizer.to_str()),
                    n_vocab=self.vocab_size,
                    eos_token=self._hf.eos_token_id,
                )
            return self._lltok

    def compile(self, grammar: Grammar) -> str:
        """The validated llguidance grammar of `grammar`; ProtocolError naming the field."""
        with self._lock:
            hit = self._compiled.pop(grammar, None)
        if hit is None:
            hit = self._validate(grammar)
        with self._lock:
            self._compiled[grammar] = hit
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return hit

    def _validate(self, grammar: Grammar) -> str:
        llg = _llguidance()
        where = f"sampling_params.{grammar.kind}"
        try:
            if grammar.kind == "regex":
                text = llg.LLMatcher.grammar_from_regex(grammar.text)
            elif grammar.kind == "ebnf":
                text = llg.LLMatcher.grammar_from_lark(grammar.text)
            else:
                text = llg.LLMatcher.grammar_from_json_schema(json.loads(grammar.text))
        except (ValueError, TypeError) as e:  # malformed JSON schema text, bad arguments
            raise ProtocolError(f"{where}: not supported: {e}") from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer())
        if failed:
            raise ProtocolError(f"{where}: not supported: {'; '.join(messages)}")
        return str(text)


def _plain_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer with its non-special added tokens (`<tool_call>`, ...) as ordinary
    vocabulary entries: llguidance treats every added token as special, masks it in where the
    grammar's text spells it, then refuses it when consumed. Padding and truncation are off."""
    spec = json.loads(tokenizer_json)
    spec["padding"] = spec["truncation"] = None
    vocab = spec.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        plain = [t for t in spec.get("added_tokens", []) if not t.get("special")]
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t.get("special")]
        vocab.update({t["content"]: t["id"] for t in plain})
    return json.dumps(spec)


class Constraint:
    """Where one generation stands in its grammar."""

    def __init__(self, matcher: Any, terminators: torch.Tensor, *, eos_id: int) -> None:
        # llguidance.numpy, not llguidance.torch: the latter runs torch.compile at import (~10 s)
        import llguidance.numpy

        self._matcher = matcher
        self._terminators = terminators
        self._vocab_size = len(terminators)
        self._eos = eos_id  # llguidance allows it at a complete output; the caller decides
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self._vocab_size)
        self._fill = llguidance.numpy.fill_next_token_bitmask

    def allowed(self) -> torch.Tensor:
        """Bool mask of the tokens allowed next (terminators only once the output is complete)."""
        if self._matcher.is_stopped() or self._matcher.is_error():
            mask = torch.zeros(self._vocab_size, dtype=torch.bool, device="cpu")
        else:
            self._fill(self._matcher, self._bitmask, 0)
            words = torch.from_numpy(self._bitmask[0]).unsqueeze(1)
            mask = ((words >> _BITS) & 1).bool().flatten()[: self._vocab_size]
            if 0 <= self._eos < self._vocab_size:
                mask[self._eos] = False  # EOS is a terminator like any other (ignore_eos)
        if self._matcher.is_accepting():
            mask = mask | self._terminators
        return mask

    def advance(self, token: int) -> None:
        """Consume a sampled token (a terminator ends the call: nothing to consume)."""
        if bool(self._terminators[token]) or self._matcher.is_stopped():
            return
        self._matcher.consume_token(token)
