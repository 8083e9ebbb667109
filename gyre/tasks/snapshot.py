"""Workspace snapshots: a content hash names the assessed state; a frozen copy preserves it.

Every assessment refers to the exact workspace state it scored (paper §5.2). The state's
id is a hash over the workspace's files (relative path, kind, executable bit, content or
symlink target), so two identical states share one id whatever order files were written in.
`freeze` copies the preserved workspace once into `<snapshots>/<id>/`; evaluator retries
and later re-scoring read that copy, never the live directory.

Ignored (not task state): the harness's HOME (`.gyre_home`), `__pycache__`, `.pytest_cache`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

from gyre import fsafe
from gyre.errors import HarnessError

IGNORED_NAMES = frozenset({".gyre_home", "__pycache__", ".pytest_cache"})
HOME_DIRNAME = ".gyre_home"


def snapshot_id(root: str | Path) -> str:
    """Content id of the workspace at `root`: 'ws-' + 32 hex digits of a SHA-256."""
    h = hashlib.sha256()
    for rel, kind, payload in _entries(Path(root)):
        h.update(f"{rel}\0{kind}\0{len(payload)}\0".encode())
        h.update(payload)
    return "ws-" + h.hexdigest()[:32]


def _entries(root: Path) -> list[tuple[str, str, bytes]]:
    """(relative path, kind, payload) for every entry under root, sorted by path."""
    if not root.is_dir():
        raise HarnessError(f"workspace {str(root)!r} does not exist")
    out: list[tuple[str, str, bytes]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in IGNORED_NAMES]
        base = Path(dirpath)
        for name in dirnames + filenames:
            p = base / name
            rel = p.relative_to(root).as_posix()
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out.append((rel, "link", os.readlink(p).encode()))
            elif stat.S_ISDIR(st.st_mode):
                out.append((rel, "dir", b""))
            elif stat.S_ISREG(st.st_mode):
                kind = "exec" if st.st_mode & stat.S_IXUSR else "file"
                out.append((rel, kind, p.read_bytes()))
    out.sort()
    return out


def copy_workspace(src: str | Path, dst: str | Path) -> None:
    """Copy a workspace (symlinks kept as links, ignored names skipped); dst must not exist."""
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED_NAMES))


def freeze(workspace: str | Path, snapshots_dir: str | Path) -> tuple[str, Path]:
    """Preserve the workspace's current state; returns (snapshot id, frozen copy path)."""
    sid = snapshot_id(workspace)
    dest = Path(snapshots_dir) / sid
    if not dest.exists():
        Path(snapshots_dir).mkdir(parents=True, exist_ok=True)
        staging = fsafe.make_temp_dir(f".{sid}.", Path(snapshots_dir))
        try:
            tmp = staging / "copy"
            copy_workspace(workspace, tmp)
            if snapshot_id(tmp) != sid:  # changed while copying: the copy is what we assess
                sid = snapshot_id(tmp)
                dest = Path(snapshots_dir) / sid
            if not dest.exists():
                tmp.rename(dest)
        finally:
            fsafe.remove_tree(staging, ignore_errors=True)
    return sid, dest
