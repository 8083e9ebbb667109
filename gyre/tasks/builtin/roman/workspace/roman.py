def to_roman(n):
    raise NotImplementedError


def from_roman(s):
    raise NotImplementedError
