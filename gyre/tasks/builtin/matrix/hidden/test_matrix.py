from matrix import identity, matmul, transpose


def test_transpose():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


def test_identity():
    assert identity(3) == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


def test_matmul():
    assert matmul([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]


def test_matmul_rect():
    assert matmul([[1, 2, 3]], [[1], [2], [3]]) == [[14]]


def test_matmul_identity():
    m = [[2, -1], [0, 3]]
    assert matmul(m, identity(2)) == m


def test_shape_error():
    try:
        matmul([[1, 2]], [[1, 2]])
    except ValueError:
        return
    raise AssertionError("matmul accepted mismatched shapes")
