from fizzbuzz import fizzbuzz


def test_empty():
    assert fizzbuzz(0) == []


def test_first_five():
    assert fizzbuzz(5) == ["1", "2", "Fizz", "4", "Buzz"]


def test_fifteen():
    assert fizzbuzz(15)[-1] == "FizzBuzz"


def test_length():
    assert len(fizzbuzz(100)) == 100


def test_counts():
    out = fizzbuzz(30)
    assert out.count("FizzBuzz") == 2 and out.count("Fizz") == 8 and out.count("Buzz") == 4
