from roman import from_roman, to_roman


def test_basic():
    assert to_roman(1) == "I" and to_roman(5) == "V" and to_roman(10) == "X"


def test_subtractive():
    assert to_roman(4) == "IV" and to_roman(9) == "IX" and to_roman(40) == "XL"


def test_large():
    assert to_roman(1994) == "MCMXCIV" and to_roman(3999) == "MMMCMXCIX"


def test_from():
    assert from_roman("MCMXCIV") == 1994 and from_roman("III") == 3


def test_roundtrip():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 4000))


def test_range():
    for bad in (0, 4000, -1):
        try:
            to_roman(bad)
        except ValueError:
            continue
        raise AssertionError(f"to_roman({bad}) did not raise ValueError")
