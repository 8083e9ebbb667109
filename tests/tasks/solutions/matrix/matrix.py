def transpose(m):
    return [list(col) for col in zip(*m)]


def matmul(a, b):
    if len(a[0]) != len(b):
        raise ValueError("shape mismatch")
    return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]
