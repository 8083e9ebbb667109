from intervals import merge, total_length


def test_empty():
    assert merge([]) == []


def test_disjoint():
    assert merge([[5, 6], [1, 2]]) == [[1, 2], [5, 6]]


def test_overlap():
    assert merge([[1, 3], [2, 6], [8, 10], [15, 18]]) == [[1, 6], [8, 10], [15, 18]]


def test_touching():
    assert merge([[1, 2], [2, 3]]) == [[1, 3]]


def test_nested():
    assert merge([[1, 10], [2, 3], [4, 5]]) == [[1, 10]]


def test_total_length():
    assert total_length([[1, 3], [2, 6], [8, 10]]) == 7
