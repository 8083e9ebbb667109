from calc import add


def test_small():
    assert add(1, 2) == 3


def test_negative():
    assert add(-4, 1) == -3


def test_float():
    assert abs(add(0.5, 0.25) - 0.75) < 1e-12
