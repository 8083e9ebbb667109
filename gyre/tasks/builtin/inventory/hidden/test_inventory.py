from inventory import Stock
from inventory.report import low_stock


def make():
    s = Stock()
    s.add("north", "bolts", 10)
    s.add("south", "bolts", 5)
    s.add("north", "nuts", 3)
    s.add("south", "washers", 1)
    return s


def test_quantity():
    assert make().quantity("bolts") == 15


def test_total():
    assert make().total() == 19


def test_remove():
    s = make()
    s.remove("north", "bolts", 4)
    assert s.quantity("bolts") == 11


def test_remove_too_many():
    s = make()
    try:
        s.remove("north", "nuts", 4)
    except ValueError:
        assert s.quantity("nuts") == 3
        return
    raise AssertionError("removing more than available was accepted")


def test_low_stock():
    assert low_stock(make(), 3) == [("washers", 1)]


def test_low_stock_sorted():
    assert low_stock(make(), 100) == [("bolts", 15), ("nuts", 3), ("washers", 1)]
