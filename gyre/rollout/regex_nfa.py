"""A small regex engine for constrained decoding: parse → Thompson NFA → lazy DFA.

The constraint only needs "which characters may come next", for one whole-string pattern,
and it needs it fast for large generated patterns (the proxy's forced tool-call regex has
one `{0,64}`-bounded string slot per argument of every tool). Eager DFA construction (for
example `interegular`) takes seconds to minutes on such patterns; here DFA states are
built lazily, only for the prefixes actually generated.

Supported syntax (Python `re` meaning, matched against the whole output): literals and
escaped punctuation, `.` (any character but newline), classes `[...]` / `[^...]` with ranges,
`\\d \\w \\s \\D \\W \\S` (Unicode, as Python), `\\n \\t \\r \\f \\v \\xhh \\uhhhh`, groups
`(...)`, `(?:...)`, `(?P<name>...)`, alternation, `* + ? {m} {m,} {m,n}` (lazy `?` suffixes
accepted: they do not change the language), `^` at the very start and `$` at the very end.
Anything else (lookarounds, backreferences, inline flags) raises `RegexSyntaxError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_REPEAT = 10_000  # unbounded `{m,}` repeats copy the sub-pattern m times


class RegexSyntaxError(ValueError):
    """The pattern uses syntax outside the supported subset (message says which)."""


# ----- character sets -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CharSet:
    ranges: tuple[tuple[int, int], ...] = ()
    classes: frozenset[str] = frozenset()  # subset of "dwsDWS"
    negated: bool = False

    def __contains__(self, ch: str) -> bool:
        c = ord(ch)
        hit = any(lo <= c <= hi for lo, hi in self.ranges) or any(
            _CLASS_TESTS[k](ch) for k in self.classes
        )
        return hit != self.negated


_CLASS_TESTS: dict[str, Callable[[str], bool]] = {
    "d": str.isdecimal,
    "w": lambda c: c.isalnum() or c == "_",
    "s": str.isspace,
    "D": lambda c: not c.isdecimal(),
    "W": lambda c: not (c.isalnum() or c == "_"),
    "S": lambda c: not c.isspace(),
}
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}
DOT = CharSet(ranges=((10, 10),), negated=True)


# ----- syntax tree ------------------------------------------------------------------------
Node = tuple  # ("set", CharSet) | ("cat", [Node]) | ("alt", [Node]) | ("rep", Node, m, n|None)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def parse(self) -> Node:
        if self.p.startswith("^"):
            self.i = 1
        node = self.alternation()
        if self.i < len(self.p):
            raise self.error("unbalanced ')'")
        return node

    def error(self, what: str) -> RegexSyntaxError:
        return RegexSyntaxError(f"{what} at position {self.i} of {self.p!r}")

    def peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> Node:
        items: list[Node] = []
        while self.peek() not in ("", "|", ")"):
            if self.peek() == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def quantified(self, node: Node) -> Node:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                m, n = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self._is_counted():
                m, n = self._counts()
            else:
                return node
            if self.peek() in ("?", "+"):  # lazy / possessive: same language
                self.i += 1
            node = ("rep", node, m, n)

    def _is_counted(self) -> bool:
        j = self.p.find("}", self.i)
        body = self.p[self.i + 1 : j] if j > 0 else ""
        parts = body.split(",")
        return bool(body) and len(parts) <= 2 and all(x.isdigit() or x == "" for x in parts)

    def _counts(self) -> tuple[int, int | None]:
        j = self.p.index("}", self.i)
        parts = self.p[self.i + 1 : j].split(",")
        self.i = j + 1
        m = int(parts[0] or 0)
        n = m if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if (n is not None and n < m) or max(m, n or 0) > MAX_REPEAT:
            raise self.error(f"bad repeat {{{','.join(parts)}}}")
        return m, n

    def atom(self) -> Node:
        c = self.peek()
        self.i += 1
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", DOT)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in ("*", "+", "?"):
            raise self.error(f"nothing to repeat before {c!r}")
        if c in ("^", "$"):
            raise self.error(f"anchor {c!r} inside the pattern is not supported")
        return ("set", _char(c))

    def group(self) -> Node:
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?P<", self.i):
            self.i = self.p.index(">", self.i) + 1
        elif self.peek() == "?":
            raise self.error("lookarounds, inline flags and backreferences are not supported")
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.i += 1
        return node

    def escape(self, *, in_class: bool) -> CharSet:
        c = self.peek()
        if not c:
            raise self.error("pattern ends with a backslash")
        self.i += 1
        if c in "dwsDWS":
            return CharSet(classes=frozenset(c))
        if c in _SIMPLE_ESCAPES:
            return _char(_SIMPLE_ESCAPES[c])
        if c in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + width]
            self.i += width
            try:
                return _char(chr(int(digits, 16)))
            except ValueError:
                raise self.error(f"bad \\{c} escape") from None
        if c == "b" and in_class:
            return _char("\b")
        if c.isalnum():
            raise self.error(f"escape \\{c} is not supported")
        return _char(c)

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        classes: set[str] = set()
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.error("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self._class_item()
            if lo.classes:
                classes |= lo.classes
                continue
            if self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._class_item()
                if hi.classes or hi.ranges[0][0] < lo.ranges[0][0]:
                    raise self.error("bad character range")
                ranges.append((lo.ranges[0][0], hi.ranges[0][0]))
            else:
                ranges.append(lo.ranges[0])
        return CharSet(ranges=tuple(ranges), classes=frozenset(classes), negated=negated)

    def _class_item(self) -> CharSet:
        c = self.peek()
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else _char(c)


def _char(c: str) -> CharSet:
    return CharSet(ranges=((ord(c), ord(c)),))


# ----- NFA --------------------------------------------------------------------------------
@dataclass(slots=True)
class _NFA:
    sets: list[CharSet | None] = field(default_factory=list)  # None: epsilon / match state
    edges: list[list[int]] = field(default_factory=list)  # char state: [next]; eps: targets

    def new(self, charset: CharSet | None) -> int:
        self.sets.append(charset)
        self.edges.append([])
        return len(self.sets) - 1


def _build(nfa: _NFA, node: Node, out: int) -> int:
    """Add `node` to the NFA so that it continues to state `out`; returns its entry state."""
    kind = node[0]
    if kind == "set":
        s = nfa.new(node[1])
        nfa.edges[s].append(out)
        return s
    if kind == "cat":
        for item in reversed(node[1]):
            out = _build(nfa, item, out)
        return out
    if kind == "alt":
        s = nfa.new(None)
        nfa.edges[s].extend(_build(nfa, branch, out) for branch in node[1])
        return s
    _, sub, m, n = node
    if n is None:  # sub{m,}: m copies then a loop
        loop = nfa.new(None)
        nfa.edges[loop].extend([_build(nfa, sub, loop), out])
        out = loop
    else:  # optional copies, nested: (sub(sub(sub)?)?)?
        for _ in range(n - m):
            opt = nfa.new(None)
            nfa.edges[opt].extend([_build(nfa, sub, out), out])
            out = opt
    for _ in range(m):
        out = _build(nfa, sub, out)
    return out


class LazyDFA:
    """Deterministic view of a pattern's NFA, built one state at a time.

    A DFA state is an int; `step(state, ch)` returns the next state or -1 (dead); every live
    state can still reach a full match (each NFA state of a parsed regex can)."""

    def __init__(self, pattern: str) -> None:
        tree = _Parser(pattern).parse()
        self._nfa = _NFA()
        self._match = self._nfa.new(None)
        start = _build(self._nfa, tree, self._match)
        self._closures: dict[int, frozenset[int]] = {}
        self._ids: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        self._rows: list[dict[str, int]] = []  # per state: char -> next state (-1 dead)
        self.initial = self._intern(self._closure([start]))

    def accepting(self, state: int) -> bool:
        return self._match in self._sets[state]

    def step(self, state: int, ch: str) -> int:
        hit = self._rows[state].get(ch)
        return self._compute(state, ch) if hit is None else hit

    def row(self, state: int) -> dict[str, int]:
        """The transitions of `state` computed so far (a live dict: for hot loops)."""
        return self._rows[state]

    def _compute(self, state: int, ch: str) -> int:
        nxt = [
            self._nfa.edges[s][0]
            for s in self._sets[state]
            if (cs := self._nfa.sets[s]) is not None and ch in cs
        ]
        hit = self._intern(self._closure(nxt)) if nxt else -1
        self._rows[state][ch] = hit
        return hit

    def _intern(self, states: frozenset[int]) -> int:
        got = self._ids.get(states)
        if got is None:
            got = self._ids[states] = len(self._sets)
            self._sets.append(states)
            self._rows.append({})
        return got

    def _closure(self, starts: list[int]) -> frozenset[int]:
        """The char-consuming and match states reachable by epsilon moves."""
        out: set[int] = set()
        for s in starts:
            c = self._closures.get(s)
            if c is None:
                c = self._closures[s] = self._closure_one(s)
            out |= c
        return frozenset(out)

    def _closure_one(self, start: int) -> frozenset[int]:
        seen, stack, out = {start}, [start], set()
        while stack:
            s = stack.pop()
            if self._nfa.sets[s] is not None or s == self._match:
                out.add(s)
                continue
            for t in self._nfa.edges[s]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(out)


def fullmatch(pattern: str, text: str) -> bool:
    """Whether `text` is in the pattern's language, as the engine's constraint decides it."""
    dfa = LazyDFA(pattern)
    state = dfa.initial
    for ch in text:
        state = dfa.step(state, ch)
        if state < 0:
            return False
    return dfa.accepting(state)
