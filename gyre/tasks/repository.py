"""Repository tasks: an initial workspace materialized from a git repository at a commit.

SWE-bench / NL2RepoBench-style tasks start from a repository at a commit, not from a
directory shipped with the suite. `materialize` turns a task's `repository:` entry into a
checkout that serves as the task's `workspace`:

1. `git clone --no-hardlinks` of the local repository, then a detached checkout of the
   commit (a ref is resolved to its commit first);
2. the history is cut to that commit's ancestry: no branch, tag, remote or reflog is kept
   and unreachable objects are pruned, so a later commit (the fix) is not in the workspace;
3. the task's setup commands run once in the checkout (each must exit 0 within the limit).

The checkout keeps its `.git`: a harness may read `git log` or take a `git diff` of its
work. Its history is the repository's up to the commit, so the task's hidden tests must not
be in that history (the dataset author's responsibility). `.gyre_home/` (the harness's
HOME inside the workspace) is listed in `.git/info/exclude`, so `git status` shows only
the harness's own changes.

Checkouts are cached under `$GYRE_CACHE_DIR/repos/` (default `~/.cache/gyre/repos/`) in a
directory named by a hash of the repository's path, the resolved commit and the setup
commands; a later load reuses it. A checkout is built in a temporary directory and renamed
into place when complete, so a crash never leaves a half-built entry under the final name.

    workspace = materialize(RepositoryConfig(path="repo", commit="v1.2"), suite_dir,
                            where="suite.yaml.tasks[0]", task="fix-parser")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gyre import cache, fsafe
from gyre.errors import ConfigError
from gyre.lifetime import die_with_parent

CACHE_FORMAT = 1
"""Bumped when the way a checkout is built changes, so old cache entries are not reused."""
GIT = ["git", "-c", "advice.detachedHead=false", "-c", "core.hooksPath=/dev/null"]


@dataclass(kw_only=True, slots=True)
class RepositoryConfig:
    """A task's initial state as a local git repository at a commit."""

    # local git repository (its top directory), relative to the suite file or task directory
    path: str
    # commit id or ref (branch, tag) the workspace is checked out at
    commit: str
    # commands (argv lists) run once, in order, in the checkout; each must exit 0
    setup: list[list[str]] = field(default_factory=list)
    # limit of each git step and each setup command, seconds
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("path: required; allowed: a local git repository directory")
        if not self.commit.strip() or self.commit.startswith("-"):
            raise ConfigError(f"commit: {self.commit!r}; allowed: a commit id or ref")
        for i, argv in enumerate(self.setup):
            if not argv or not argv[0]:
                raise ConfigError(f"setup[{i}]: {argv!r}; allowed: a non-empty argv list")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s: {self.timeout_s!r} must be a finite number > 0")


def cache_root() -> Path:
    """Where checkouts are cached: `$GYRE_CACHE_DIR/repos` (default `~/.cache/gyre/repos`)."""
    return cache.root() / "repos"


def source_path(cfg: RepositoryConfig, base: Path) -> Path:
    """The repository directory a task names, resolved against the suite's directory."""
    return (base / cfg.path).resolve()


def materialize(cfg: RepositoryConfig, base: Path, *, where: str, task: str) -> Path:
    """The cached checkout of the repository at the commit, built on first use.

    `where` and `task` name the task in a `ConfigError` (bad path, unknown commit, a git
    step or setup command that fails or runs out of time).
    """
    source = source_path(cfg, base)
    at = f"{where}.repository"
    _check_source(source, cfg.timeout_s, at)
    commit = _resolve_commit(source, cfg, at)
    key = json.dumps([CACHE_FORMAT, str(source), commit, cfg.setup])
    dest = cache_root() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if dest.is_dir():  # entries appear only by rename, complete
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = fsafe.make_temp_dir(f".{dest.name}-", dest.parent)
    try:
        _checkout(source, commit, tmp, cfg.timeout_s, at)
        for i, argv in enumerate(cfg.setup):
            _setup(argv, tmp, cfg.timeout_s, f"{at}.setup[{i}]", task)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished the same entry first: use it
            if not dest.is_dir():
                raise
    finally:
        fsafe.remove_tree(tmp, ignore_errors=True)
    return dest


def _check_source(source: Path, timeout_s: float, at: str) -> None:
    """`source` must be the top directory of a git repository (or a bare repository), not
    a directory somewhere inside another one."""
    if not source.is_dir():
        raise ConfigError(f"{at}.path: {str(source)!r} does not exist or is not a directory")
    rc, out = _run([*GIT, "rev-parse", "--is-bare-repository", "--show-cdup"], source, timeout_s)
    bare, _, cdup = out.strip().partition("\n")
    if rc != 0 or (bare == "false" and cdup.strip()):
        said = f" (git: {_tail(out)})" if rc != 0 else ""  # e.g. dubious ownership
        raise ConfigError(
            f"{at}.path: {str(source)!r} is not the top directory of a git repository{said}"
        )


def _resolve_commit(source: Path, cfg: RepositoryConfig, at: str) -> str:
    """The full commit id `cfg.commit` names in `source`, or a ConfigError."""
    argv = [*GIT, "rev-parse", "--verify", "--quiet", "--end-of-options"]
    argv.append(f"{cfg.commit}^{{commit}}")
    rc, out = _run(argv, source, cfg.timeout_s)
    lines = out.split()  # a warning on stderr may come first; the id is the last word
    if rc != 0 or not lines:
        raise ConfigError(
            f"{at}.commit: {cfg.commit!r} is not a commit of {str(source)!r}; "
            "allowed: a commit id, branch or tag of that repository"
        )
    return lines[-1]


def _checkout(source: Path, commit: str, dest: Path, timeout_s: float, at: str) -> None:
    """Clone `source` into the empty directory `dest` at `commit`, with only its history."""
    steps = [
        [*GIT, "clone", "--no-hardlinks", "--no-checkout", "--quiet", str(source), str(dest)],
        [*GIT, "checkout", "--quiet", "--detach", commit],
        [*GIT, "remote", "remove", "origin"],
    ]
    for argv in steps:
        _git(argv, dest, timeout_s, at)
    _, refs = _run([*GIT, "for-each-ref", "--format=%(refname)"], dest, timeout_s)
    for ref in refs.split():
        _git([*GIT, "update-ref", "-d", ref], dest, timeout_s, at)
    _git([*GIT, "reflog", "expire", "--expire=now", "--all"], dest, timeout_s, at)
    _git([*GIT, "gc", "--prune=now", "--quiet"], dest, timeout_s, at)
    (dest / ".git" / "info").mkdir(exist_ok=True)
    with (dest / ".git" / "info" / "exclude").open("a") as f:
        f.write("\n# the harness's HOME inside the workspace (gyre)\n.gyre_home/\n")


def _git(argv: list[str], cwd: Path, timeout_s: float, at: str) -> None:
    rc, out = _run(argv, cwd, timeout_s)
    if rc != 0:
        raise ConfigError(f"{at}: `{' '.join(argv[5:])}` exited {rc}: {_tail(out)}")


def _setup(argv: list[str], cwd: Path, timeout_s: float, at: str, task: str) -> None:
    rc, out = _run(argv, cwd, timeout_s)
    if rc != 0:
        status = f"ran past {timeout_s:g}s" if rc is None else f"exited {rc}"
        raise ConfigError(
            f"{at}: task {task!r}: setup command {argv!r} {status}; its output ends: {_tail(out)}"
        )


def _run(argv: list[str], cwd: Path, timeout_s: float) -> tuple[int | None, str]:
    """(exit status or None on timeout or a missing program, stdout and stderr together).

    The command runs in its own process group, killed whole when it ends or times out.
    """
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                die_with_parent(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            )  # fmt: skip
        except OSError as e:
            return 127, f"cannot start {argv[0]!r}: {e.strerror or e}"
        try:
            rc: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        return rc, out.read().decode(errors="replace")


def _tail(text: str, limit: int = 500) -> str:
    text = text.strip()
    return repr(text[-limit:]) if text else "(no output)"
