"""Rows of a data-file task suite: a JSON Lines or a Parquet file, one task per row.

Only the file formats live here; what a row means (task keys, data, defaults) is
`gyre.tasks.suite`'s. Each row comes with the name it goes by in error messages:

    read_rows(Path("answers.jsonl"))    # [("answers.jsonl:1", {...}), ("answers.jsonl:2", ...)]
    read_rows(Path("answers.parquet"))  # [("answers.parquet[0]", {...}), ...]

JSONL rows are named by their 1-based line number (blank lines are skipped), Parquet rows by
their 0-based index. Parquet is read with pyarrow (imported on first use: a harness process
that only needs a task's tool latency never loads it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError

DATA_SUFFIXES = (".jsonl", ".parquet")
"""File name endings that `load_suite` reads as data-file suites."""

Row = tuple[str, dict[str, Any]]


def read_rows(path: Path) -> list[Row]:
    """`(where, row)` for each row of a `.jsonl` or `.parquet` file, in file order."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(path)
    if suffix == ".parquet":
        return _parquet_rows(path)
    raise ConfigError(
        f"data suite {str(path)!r}: unknown file type {suffix!r}; allowed: "
        + ", ".join(DATA_SUFFIXES)
    )


def _jsonl_rows(path: Path) -> list[Row]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {str(path)!r}: {e}") from None
    rows: list[Row] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: {row!r:.80} is not a task; allowed: a JSON object")
        rows.append((where, row))
    return rows


def _parquet_rows(path: Path) -> list[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise ConfigError(f"{str(path)!r} is not a readable Parquet file: {e}") from None
    return [(f"{path.name}[{i}]", row) for i, row in enumerate(table.to_pylist())]
