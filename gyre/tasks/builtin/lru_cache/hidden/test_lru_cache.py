from lru import LRUCache


def test_get_put():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1 and c.get("b") is None


def test_evicts_lru():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.get("a")
    c.put("c", 3)
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3


def test_update_moves_to_front():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("a", 10)
    c.put("c", 3)
    assert c.get("a") == 10 and c.get("b") is None


def test_len():
    c = LRUCache(3)
    for i in range(10):
        c.put(i, i)
    assert len(c) == 3


def test_bad_capacity():
    try:
        LRUCache(0)
    except ValueError:
        return
    raise AssertionError("capacity 0 accepted")
