from text_utils import reverse_words


def test_three_words():
    assert reverse_words("hello big world") == "world big hello"


def test_single_word():
    assert reverse_words("gyre") == "gyre"


def test_extra_spaces():
    assert reverse_words("  a   b  ") == "b a"


def test_empty():
    assert reverse_words("") == ""
