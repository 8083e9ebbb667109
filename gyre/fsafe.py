"""Nothing a user owns is ever lost: Gyre deletes only what it made and writes apart from
what it reads.

Three rules, each one function here, for every command that writes files:

* **Delete only what Gyre made.** Every removal of a directory tree in the package goes
  through `remove_tree`. It removes a temporary directory this process made
  (`make_temp_dir`, `temp_dir`, and anything inside one), or a directory whose marker file
  (`.gyre-owned`, written by `fresh_dir` or `move_into_place`) names the maker asking;
  anything else is refused with `UnsafePathError`, so a path a user typed (`gyre eval
  MODEL_DIR`, `--out RUN/policies`) is never wiped.
* **Outputs apart from inputs.** `check_outputs_apart` refuses, before anything is written,
  an output that is, lies inside or contains an input (symlinks resolved).
* **Write or say why.** `writing(path)` turns the `OSError` of a write (a read-only
  directory, a full disk) into `OutputError` naming the path: one line and exit status 2 at
  the command line (`gyre.errors.exit_status`), not a traceback.

Directories Gyre makes for people follow the umask (`follow_umask`): `mkdtemp`'s 0700 would
hide a policy or a checkpoint from colleagues on a shared file system.

    work = fresh_dir(out / "final", "gyre eval")     # new, empty, or its own earlier one
    check_outputs_apart({"--out": out}, {"the model": model_dir})
    with writing(out):
        (work / "result.json").write_text(text)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from gyre.errors import GyreError

MARKER = ".gyre-owned"
"""The file in a directory Gyre made for itself; its text names the maker (`gyre eval`)."""

_made: set[Path] = set()  # temporary directories this process made (resolved), not yet removed
_made_lock = threading.Lock()  # scoring removes its scratch copies from worker threads


class UnsafePathError(GyreError):
    """Deleting or writing this path could lose something Gyre did not make."""


class OutputError(GyreError):
    """An output cannot be written (read-only directory, full disk, no permission)."""


def make_temp_dir(prefix: str = "gyre-", parent: Path | None = None) -> Path:
    """A new private temporary directory (`tempfile.mkdtemp`) that `remove_tree` may remove."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    with _made_lock:
        _made.add(path.resolve())
    return path


@contextlib.contextmanager
def temp_dir(prefix: str = "gyre-") -> Iterator[Path]:
    """`make_temp_dir` for the length of a `with` block, removed at its end."""
    path = make_temp_dir(prefix)
    try:
        yield path
    finally:
        remove_tree(path, ignore_errors=True)


def maker_of(path: Path) -> str | None:
    """Who made directory `path`, by its marker file; None: not a directory Gyre made."""
    marker = path / MARKER
    if path.is_symlink() or marker.is_symlink() or not marker.is_file():
        return None
    try:
        return marker.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _made_here(path: Path) -> bool:
    real = path.resolve()
    with _made_lock:
        return any(real == d or d in real.parents for d in _made)


def _forget(path: Path) -> None:
    with _made_lock:
        _made.discard(path.resolve())


def remove_tree(path: Path, made_by: str | None = None, *, ignore_errors: bool = False) -> None:
    """Remove directory `path` and everything in it, if Gyre made it: a temporary directory
    of this process (or a path inside one), or a directory marked as `made_by`'s. Anything
    else (a symlink included) raises `UnsafePathError`; `ignore_errors` only ignores the
    file system's errors while removing (a path already gone, ...)."""
    if path.is_symlink():
        raise UnsafePathError(f"{path} is a symbolic link; gyre removes only directories it made")
    if not _made_here(path) and (made_by is None or maker_of(path) != made_by):
        who = f"{made_by!r}" if made_by else "this process"
        raise UnsafePathError(
            f"{path}: not removed: gyre did not create it (no {MARKER} from {who} in it)"
        )
    try:
        _remove_marker_last(path)
    except OSError:
        if not ignore_errors:
            raise
    _forget(path)


def _remove_marker_last(path: Path) -> None:
    """Remove a directory tree, its marker last: a removal cut short (the process killed,
    the disk gone) leaves a directory still marked as Gyre's, which the next try may remove
    (a resumed run replacing a policy the dead job was pruning)."""
    for child in path.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (path / MARKER).unlink(missing_ok=True)
    path.rmdir()


def fresh_dir(path: Path, made_by: str) -> Path:
    """An empty directory at `path`, marked as `made_by`'s: made (parents too), an empty one
    that exists, or one `made_by` made earlier, emptied. Anything else there is refused."""
    taken = path.is_symlink() or (path.exists() and not path.is_dir())
    if taken or (path.is_dir() and any(path.iterdir())):
        if taken or maker_of(path) != made_by:
            raise UnsafePathError(
                f"{path} exists and gyre did not create it; not removed; allowed: a new or "
                f"empty directory, or one {made_by} made"
            )
        remove_tree(path, made_by)
    path.mkdir(parents=True, exist_ok=True)
    _mark(path, made_by)
    return path


def move_into_place(tmp: Path, final: Path, made_by: str) -> Path:
    """Rename a finished `make_temp_dir` directory to `final`, marked as `made_by`'s and
    readable as the umask allows; an earlier `final` that `made_by` made is replaced (any
    other is refused). A reader never sees half a directory (between the two, none)."""
    _mark(tmp, made_by)
    follow_umask(tmp)
    if final.exists() or final.is_symlink():
        remove_tree(final, made_by)
    _forget(tmp)
    tmp.rename(final)
    return final


def adopt(path: Path, made_by: str, signature: tuple[str, ...]) -> None:
    """Mark a directory an earlier Gyre wrote before markers existed (a policy or checkpoint
    of an older run, recognised by the files `signature` it always holds, none a symlink) as
    `made_by`'s, so a resumed old run can replace or prune it. Anything else stays as it is."""
    if (
        path.is_dir()
        and not path.is_symlink()
        and maker_of(path) is None
        and all((path / f).is_file() for f in signature)
        and not any(p.is_symlink() for p in path.iterdir())
    ):
        _mark(path, made_by)


def _mark(path: Path, made_by: str) -> None:
    """Write the marker; a half-written one (a full disk) is not left to block the next try."""
    marker = path / MARKER
    try:
        marker.write_text(made_by + "\n")
    except OSError:
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)
        raise


def check_outputs_apart(
    outputs: Mapping[str, Path | str], inputs: Mapping[str, Path | str]
) -> None:
    """Refuse an output path that is, lies inside or contains an input path (both resolved,
    so a symlink does not hide one). Keys name the paths in the message (`--out`, `the
    trace`)."""
    for out_name, out in outputs.items():
        o = Path(out).resolve()
        for in_name, inp in inputs.items():
            i = Path(inp).resolve()
            how = "is" if o == i else "is inside" if i in o.parents else "contains"
            if how != "contains" or o in i.parents:
                raise UnsafePathError(
                    f"{out_name} {out} {how} {in_name} ({inp}); gyre does not write over "
                    "what it reads; allowed: an output apart from its inputs"
                )


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes to `path` (a file or a directory written into): an `OSError` becomes
    `OutputError` naming the file, else `path`, and the reason (read-only, full disk)."""
    try:
        yield
    except OSError as e:
        where = e.filename if e.filename is not None else path
        raise OutputError(f"cannot write {where}: {e.strerror or e}") from None


def safe_name(text: str) -> str:
    """`text` as one path component: letters, digits, `.`, `_`, `-` (never `.` or `..`)."""
    name = re.sub(r"[^\w.-]+", "-", text).strip(".-")
    return name or "model"


def umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def follow_umask(folder: Path) -> None:
    """Directories and files under `folder` (itself included) as readable as the umask
    allows: `mkdtemp` makes 0700 and safetensors 0600, where a run's other files follow the
    umask (a group on a shared file system)."""
    mask = umask()
    folder.chmod(0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            mode = p.lstat().st_mode
            if stat.S_ISDIR(mode) or (stat.S_ISREG(mode) and mode & stat.S_IXUSR):
                p.chmod(0o777 & ~mask)
            elif stat.S_ISREG(mode):
                p.chmod(0o666 & ~mask)
