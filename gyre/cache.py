"""Gyre's cache: results a process may rebuild at any time, kept between processes and runs
because rebuilding them costs time and cannot change them.

`root()` is ``$GYRE_CACHE_DIR``, else ``~/.cache/gyre``. It holds converted models
(`gyre.models`), passed model checks (`gyre.runtime.preflight`), repository checkouts
(`gyre.tasks.repository`) and the sandbox's copy of /etc (`gyre.harness.sandbox`). `keep`
writes one entry whole or not at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gyre import fsafe


def root() -> Path:
    """``$GYRE_CACHE_DIR``, else ``~/.cache/gyre``."""
    return Path(os.environ.get("GYRE_CACHE_DIR", Path.home() / ".cache" / "gyre"))


def keep(entry: Path, write: Callable[[Path], object]) -> None:
    """Write the cache directory `entry` with `write(tmp)` and rename it into place (atomic:
    a concurrent reader sees all or nothing). The cache is an optimisation only: a failure to
    write it is ignored (`entry` is then missing, or another process's copy)."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = fsafe.make_temp_dir(entry.name, entry.parent)
        write(tmp)
        tmp.rename(entry)
    except OSError:
        if tmp is not None:  # half written, or another process kept its copy first
            fsafe.remove_tree(tmp, ignore_errors=True)
