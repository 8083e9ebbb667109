import expr as mod
from expr import evaluate


def test_number():
    assert evaluate("42") == 42


def test_precedence():
    assert evaluate("2 + 3 * 4") == 14


def test_parentheses():
    assert evaluate("(2 + 3) * 4") == 20


def test_division():
    assert evaluate("7 / 2") == 3.5


def test_unary():
    assert evaluate("-3 + -(2 * 2)") == -7


def test_malformed():
    for bad in ("2 +", "(1", "1 2", ""):
        try:
            evaluate(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_no_eval():
    import inspect

    src = inspect.getsource(mod)
    assert "eval(" not in src.replace("evaluate(", "") and "exec(" not in src
