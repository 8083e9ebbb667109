from palindrome import is_palindrome


def test_simple():
    assert is_palindrome("racecar")


def test_not():
    assert not is_palindrome("gyre")


def test_case():
    assert is_palindrome("RaceCar")


def test_punctuation():
    assert is_palindrome("A man, a plan, a canal: Panama")


def test_empty():
    assert is_palindrome("")


def test_digits():
    assert is_palindrome("1a2 2A1") and not is_palindrome("12")
