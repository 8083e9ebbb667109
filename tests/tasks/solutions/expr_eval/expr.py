import re

TOKEN = re.compile(r"\s*(\d+|[-+*/()])")


def _tokens(s):
    pos, out = 0, []
    s = s.rstrip()
    while pos < len(s):
        m = TOKEN.match(s, pos)
        if not m:
            raise ValueError(f"bad input at {pos}")
        out.append(m.group(1))
        pos = m.end()
    return out


def evaluate(expr):
    toks = _tokens(expr)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        if pos >= len(toks):
            raise ValueError("unexpected end")
        pos += 1
        return toks[pos - 1]

    def atom():
        t = take()
        if t == "-":
            return -atom()
        if t == "(":
            v = sum_()
            if take() != ")":
                raise ValueError("missing )")
            return v
        if t.isdigit():
            return int(t)
        raise ValueError(f"unexpected {t}")

    def product():
        v = atom()
        while peek() in ("*", "/"):
            v = v * atom() if take() == "*" else v / atom()
        return v

    def sum_():
        v = product()
        while peek() in ("+", "-"):
            v = v + product() if take() == "+" else v - product()
        return v

    v = sum_()
    if pos != len(toks):
        raise ValueError("trailing input")
    return v
