"""Regex-constrained decoding (SGLang's `sampling_params.regex`).

The proxy forces tool calls (tool_choice "required" or a named tool) by sending a regex the
whole output text must match. The pattern is parsed once into an NFA whose DFA states are
built lazily (gyre.rollout.regex_nfa: eager DFA construction takes seconds to minutes on
the proxy's generated tool-call patterns). For each DFA state the engine needs the
set of tokens whose decoded text keeps the output a prefix of the language: it walks a
character trie of the vocabulary along DFA transitions (so a literal stretch of the pattern
touches only a few trie nodes) and caches the result per state. At a step:

* allowed = tokens that keep the text a live prefix, plus the terminators (EOS and
  `stop_token_ids`) when the text already fully matches;
* the sampled distribution is the masked, renormalized one (see `gyre.rollout.sampling`),
  so behaviour log-probs stay exact; when only a terminator is allowed it is emitted with
  log-prob 0.

Tokens whose bytes are not valid UTF-8 on their own and special tokens (other than the
terminators) are never allowed under a constraint, so a pattern can only require characters
the vocabulary spells with whole-character tokens (all of ASCII with a byte-level BPE).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre.errors import ProtocolError
from gyre.rollout.regex_nfa import LazyDFA, RegexSyntaxError


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (printable bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_texts(tokenizer: Any) -> dict[int, str]:
    """Decoded text of every token usable under a constraint (special tokens excluded)."""
    special = set(tokenizer.all_special_ids)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if not t.special}
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder()
    out: dict[int, str] = {}
    for piece, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if i in added:
            out[i] = added[i]
            continue
        try:
            if byte_level:
                text = bytes(decoder[c] for c in piece).decode("utf-8")
            else:
                text = tokenizer.decode([i])
        except (KeyError, UnicodeDecodeError):
            continue
        if text:
            out[i] = text
    return out


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


@dataclass(slots=True)
class _Trie:
    children: list[dict[str, int]] = field(default_factory=lambda: [{}])
    tokens: list[list[int]] = field(default_factory=lambda: [[]])

    def add(self, text: str, token: int) -> None:
        node = 0
        for ch in text:
            nxt = self.children[node].get(ch)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][ch] = nxt
                self.children.append({})
                self.tokens.append([])
            node = nxt
        self.tokens[node].append(token)


class RegexFSM:
    """One compiled pattern over one vocabulary, with per-state token sets cached."""

    def __init__(self, pattern: str, trie: _Trie, vocab_size: int) -> None:
        try:
            self._dfa = LazyDFA(pattern)
        except RegexSyntaxError as e:
            raise ProtocolError(f"sampling_params.regex: not supported: {e}") from None
        self.pattern = pattern
        self.initial = self._dfa.initial
        self._trie = trie
        self._vocab_size = vocab_size
        self._cache: dict[int, tuple[torch.Tensor, dict[int, int]]] = {}
        if not self._dfa.accepting(self.initial) and not self.transitions(self.initial)[1]:
            raise ProtocolError(
                f"sampling_params.regex: {pattern!r} matches nothing this vocabulary can spell"
            )

    def accepting(self, state: int) -> bool:
        return self._dfa.accepting(state)

    def transitions(self, state: int) -> tuple[torch.Tensor, dict[int, int]]:
        """(bool mask of allowed non-terminator tokens, token -> next state) for `state`."""
        hit = self._cache.get(state)
        if hit is None:
            hit = self._cache[state] = self._walk(state)
        return hit

    def _walk(self, state: int) -> tuple[torch.Tensor, dict[int, int]]:
        nxt_of: dict[int, int] = {}
        step, row_of = self._dfa.step, self._dfa.row
        children, tokens = self._trie.children, self._trie.tokens
        stack = [(0, state)]
        while stack:
            node, s = stack.pop()
            row = row_of(s)
            for ch, child in children[node].items():
                t = row.get(ch)
                if t is None:
                    t = step(s, ch)
                if t < 0:
                    continue
                for tok in tokens[child]:
                    nxt_of[tok] = t
                stack.append((child, t))
        mask = torch.zeros(self._vocab_size, dtype=torch.bool)
        if nxt_of:
            mask[list(nxt_of)] = True
        return mask, nxt_of


class RegexCompiler:
    """Compiles patterns for one tokenizer; keeps the most recent ones (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, capacity: int = 64) -> None:
        self._trie = _Trie()
        for token, text in token_texts(tokenizer).items():
            if token < vocab_size:
                self._trie.add(text, token)
        self._vocab_size = vocab_size
        self._capacity = capacity
        self._compiled: OrderedDict[str, RegexFSM] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, pattern: str) -> RegexFSM:
        """The compiled pattern (thread-safe; compiling happens outside the lock)."""
        with self._lock:
            fsm = self._compiled.pop(pattern, None)
        if fsm is None:
            fsm = RegexFSM(pattern, self._trie, self._vocab_size)
        with self._lock:
            self._compiled[pattern] = fsm
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return fsm


class RegexState:
    """Where one generation stands in its pattern."""

    def __init__(self, fsm: RegexFSM, terminators: torch.Tensor) -> None:
        self.fsm = fsm
        self.state = fsm.initial
        self._terminators = terminators

    def allowed(self) -> torch.Tensor:
        """Mask of tokens allowed next (terminators only once the text fully matches)."""
        mask, _ = self.fsm.transitions(self.state)
        if self.fsm.accepting(self.state):
            mask = mask | self._terminators
        return mask

    def advance(self, token: int) -> None:
        _, nxt = self.fsm.transitions(self.state)
        if token in nxt:
            self.state = nxt[token]
