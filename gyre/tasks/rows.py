"""Rows of a data-file task suite: a JSON Lines or a Parquet file, or a Hugging Face dataset
saved to a local directory, one task per row.

Only the file formats live here; what a row means (task keys, data, defaults) is
`gyre.tasks.suite`'s. Each row comes with the name it goes by in error messages:

    read_rows(Path("answers.jsonl"))    # [("answers.jsonl:1", {...}), ("answers.jsonl:2", ...)]
    read_rows(Path("answers.parquet"))  # [("answers.parquet[0]", {...}), ...]

    read_rows(Path("answers-ds"), "test")  # [("answers-ds/test[0]", {...}), ...]

JSONL rows are named by their 1-based line number (blank lines are skipped), Parquet and
dataset rows by their 0-based index. Parquet is read with pyarrow, a dataset directory (what
`Dataset.save_to_disk` / `DatasetDict.save_to_disk` write) with the `datasets` library's own
`load_from_disk`, from local files only — nothing is fetched from a hub. Both are imported on
first use: a harness process that only needs a task's tool latency never loads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError

DATA_SUFFIXES = (".jsonl", ".parquet")
"""File name endings that `load_suite` reads as data-file suites."""
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")
"""Files that make a directory a saved Hugging Face dataset (one split / several splits)."""


def is_dataset_dir(path: Path) -> bool:
    """Whether `path` is a directory written by `Dataset(Dict).save_to_disk`."""
    return path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS)


def is_data_source(path: Path) -> bool:
    """Whether `path` holds the rows of a data suite (a data file or a saved dataset)."""
    return (path.is_file() and path.suffix.lower() in DATA_SUFFIXES) or is_dataset_dir(path)


Row = tuple[str, dict[str, Any]]


def read_rows(path: Path, split: str = "") -> list[Row]:
    """`(where, row)` for each row of a `.jsonl` or `.parquet` file, in file order, or of a
    saved dataset's split (`split` names it; a one-split directory needs none)."""
    if is_dataset_dir(path):
        return _dataset_rows(path, split)
    if split:
        raise ConfigError(
            f"split: {split!r} is set for {str(path)!r}, which is not a saved dataset; allowed: "
            "a split only for a directory written by datasets' save_to_disk"
        )
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


def _dataset_rows(path: Path, split: str) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{str(path)!r} is a saved Hugging Face dataset; reading it needs the `datasets` "
            "package (pip install 'gyre[datasets]'), or export its rows to .jsonl / .parquet"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        raise ConfigError(f"{str(path)!r} is not a readable saved dataset: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split not in loaded:
            given = f"split {split!r} is not one of them" if split else "no split is chosen"
            raise ConfigError(
                f"{str(path)!r} holds the splits {', '.join(splits)} and {given}; allowed: "
                f"`split:` in its sidecar {path.name}.suite.yaml naming one of them"
            )
        loaded, where = loaded[split], f"{path.name}/{split}"
    elif split:
        raise ConfigError(
            f"split: {split!r}, but {str(path)!r} is a dataset of one split; allowed: no split"
        )
    else:
        where = path.name
    return [(f"{where}[{i}]", row) for i, row in enumerate(loaded.to_list())]
