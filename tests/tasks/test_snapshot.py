"""Workspace snapshot ids (content hashes) and frozen copies."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.tasks.snapshot import IGNORED_NAMES, freeze, snapshot_id

names = st.text("abcxyz_", min_size=1, max_size=4)
trees = st.dictionaries(
    st.lists(names, min_size=1, max_size=3).map(lambda parts: "/".join(parts)),
    st.binary(max_size=40),
    max_size=8,
)


def write_tree(
    root: Path, files: dict[str, bytes], order: list[str] | None = None
) -> dict[str, bytes]:
    """Write files (skipping paths that clash with a directory); returns what was written."""
    root.mkdir(parents=True, exist_ok=True)
    written: dict[str, bytes] = {}
    for rel in order or sorted(files):
        p = root / rel
        if any((root / w).is_relative_to(p) or p.is_relative_to(root / w) for w in written):
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(files[rel])
        written[rel] = files[rel]
    return written


def reference_id(root: Path) -> str:
    """Slow, obvious version: list everything with rglob, drop ignored parts, hash sorted."""
    entries = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part in IGNORED_NAMES for part in rel.parts):
            continue
        if p.is_symlink():
            entries.append((rel.as_posix(), "link", os.readlink(p).encode()))
        elif p.is_dir():
            entries.append((rel.as_posix(), "dir", b""))
        else:
            kind = "exec" if os.access(p, os.X_OK) else "file"
            entries.append((rel.as_posix(), kind, p.read_bytes()))
    h = hashlib.sha256()
    for rel, kind, payload in sorted(entries):
        h.update(f"{rel}\0{kind}\0{len(payload)}\0".encode() + payload)
    return "ws-" + h.hexdigest()[:32]


@settings(max_examples=60, deadline=None)
@given(files=trees, data=st.data())
def test_snapshot_id_matches_reference_and_ignores_write_order(tmp_path_factory, files, data):
    a = tmp_path_factory.mktemp("a")
    written = write_tree(a, files)
    order = data.draw(st.permutations(sorted(written)))
    b = tmp_path_factory.mktemp("b")
    write_tree(b, written, order=list(order))
    assert snapshot_id(a) == reference_id(a) == snapshot_id(b)


@settings(max_examples=60, deadline=None)
@given(files=trees.filter(bool), data=st.data())
def test_any_content_change_changes_the_id(tmp_path_factory, files, data):
    root = tmp_path_factory.mktemp("w")
    written = write_tree(root, files)
    before = snapshot_id(root)
    rel = data.draw(st.sampled_from(sorted(written)))
    (root / rel).write_bytes(written[rel] + b"!")
    assert snapshot_id(root) != before


def test_ignored_directories_and_symlinks(tmp_path):
    write_tree(tmp_path, {"m.py": b"x = 1\n"})
    base = snapshot_id(tmp_path)
    for name in IGNORED_NAMES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "junk").write_text("session data")
    assert snapshot_id(tmp_path) == base
    (tmp_path / "link").symlink_to("/etc/passwd")
    with_link = snapshot_id(tmp_path)
    assert with_link != base and with_link == reference_id(tmp_path)
    (tmp_path / "m.py").chmod(0o755)
    assert snapshot_id(tmp_path) != with_link


def test_freeze_preserves_the_state_once(tmp_path):
    ws = tmp_path / "workspace"
    write_tree(ws, {"a.py": b"A = 1\n", "pkg/b.py": b"B = 2\n"})
    (ws / ".gyre_home").mkdir()
    (ws / ".gyre_home" / "secret").write_text("not task state")
    sid, frozen = freeze(ws, tmp_path / "snapshots")
    assert frozen == tmp_path / "snapshots" / sid
    assert snapshot_id(frozen) == sid == snapshot_id(ws)
    assert not (frozen / ".gyre_home").exists()
    (ws / "a.py").write_text("A = 2\n")  # the live workspace moves on; the snapshot does not
    assert (frozen / "a.py").read_text() == "A = 1\n"
    sid2, frozen2 = freeze(ws, tmp_path / "snapshots")
    assert sid2 != sid and frozen.exists() and frozen2.exists()
    assert freeze(ws, tmp_path / "snapshots") == (sid2, frozen2)
