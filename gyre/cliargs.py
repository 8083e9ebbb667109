"""The `gyre` command line's parser class and argument types.

Every subcommand's parser is a `Parser`: a bad argument is one line on stderr, ``gyre CMD:
error: argument --steps: -1; allowed: an integer >= 1``, and exit status 2 (argparse's own
usage block is for `--help`). Each type below refuses a bad value with what is allowed, so
no command starts work on a value it would later trip over.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from gyre import fsafe


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (subparsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}; allowed: an integer >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}; allowed: an integer >= {low}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


count = int_at_least(1)
"""A number of things (steps, instances, processes): an integer >= 1."""
size = int_at_least(0)
"""A size or seed: an integer >= 0."""


def port(text: str) -> int:
    """A TCP port; 0 lets the system choose."""
    allowed = "allowed: a port 0..65535 (0: any free one)"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; {allowed}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}; {allowed}")
    return value


def _number(text: str, low: float, strict: bool) -> float:
    allowed = f"allowed: a number {'>' if strict else '>='} {low:g}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; {allowed}") from None
    if not (value > low if strict else value >= low) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}; {allowed}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a time in seconds)."""
    return _number(text, 0.0, strict=True)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, 0.0, strict=False)


def output_file(text: str) -> str:
    """A file to write: its directory exists, and it is not a directory itself."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; allowed: a file path")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text}: directory {str(parent)!r} does not exist; allowed: a file in an "
            "existing directory"
        )
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {str(parent)!r} is not writable")
    return text


def directory_to_make(text: str) -> str:
    """A directory that exists or can be made, and written into: nothing else is at that
    path, and a probe directory can really be made in its nearest existing directory (a
    read-only file system, `/proc`, a full disk or no permission are refused here)."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("''; allowed: a directory path")
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise argparse.ArgumentTypeError(
                f"{text}: {str(p)!r} is a file; allowed: a directory (existing or new)"
            )
        if p.is_dir():
            try:
                fsafe.remove_tree(fsafe.make_temp_dir(".gyre-probe-", p))
            except OSError as e:
                raise argparse.ArgumentTypeError(
                    f"{text}: cannot make a directory in {str(p)!r} ({e.strerror or e}); "
                    "allowed: a directory gyre can write"
                ) from None
            break
    return text
