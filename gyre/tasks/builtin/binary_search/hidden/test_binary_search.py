from search import binary_search


def test_found_middle():
    assert binary_search([1, 3, 5, 7, 9], 5) == 2


def test_found_last():
    assert binary_search([1, 3, 5, 7, 9], 9) == 4


def test_found_first():
    assert binary_search([1, 3, 5, 7, 9], 1) == 0


def test_single():
    assert binary_search([4], 4) == 0


def test_missing():
    assert binary_search([1, 3, 5], 4) == -1


def test_empty():
    assert binary_search([], 1) == -1


def test_many():
    items = list(range(0, 200, 2))
    assert all(binary_search(items, x) == x // 2 for x in items)
    assert all(binary_search(items, x) == -1 for x in range(1, 200, 2))
