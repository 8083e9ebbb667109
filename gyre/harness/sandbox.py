"""The harness sandbox: one allow-list of what a harness sees, run by bubblewrap or Apptainer.

A harness is untrusted code that a policy under training drives: whatever it can read it can
copy into its answer (another task's checker, another run's workspaces), and whatever it can
write it can forge. So a sandboxed harness sees only what `allow_list` names, each entry at its
own path, and nothing else of the machine:

| entry | mode | why |
|---|---|---|
| `SYSTEM_DIRS`: /usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc | read-only | programs, libraries, certificates, passwd; Apptainer takes them from its image instead |
| the interpreter: `sys.prefix`, `sys.base_prefix`, the user site-packages | read-only | Python and the packages harnesses import |
| the `gyre` package without the folders under gyre/tasks | read-only | `python -m gyre.harness.reference_agent` / `gyre.harness.codex`; the shipped suites (tasks, hidden checkers, answers) stay out |
| the adapter's `sandbox_binds` (its node_modules or virtual environment) | read-only | Claude Code, Codex, mini-swe-agent |
| the adapter's program: each symlink on the way to its file, the file, a `#!` interpreter, and the installation prefix (the folder above `bin/`) of each | read-only | a harness installed elsewhere (system npm, nvm, ~/.local) |
| the execution's workspace | read-write | the task state; HOME and TMPDIR are inside it |
| the execution's instruction.md and feedback.jsonl | read-only | what adapters read |
| /dev (minimal), /proc (its own PID namespace), /tmp (private, empty) | new | bwrap makes them; Apptainer's --containall likewise |

Carved out of every entry above, wherever it lies (`denied`): the task's hidden files and those
of every other task of its suite, `SYSTEM_SECRETS` (/etc/shadow, sudoers, host keys, private
TLS keys), the runner's HOME, the Gyre checkout when Gyre runs from one, the directories the
runner is told to hide (the run directory and the folder of runs beside it; for `gyre eval` also
the evaluated run) and the workspace root (every other execution). A more specific entry inside
a carved-out folder is still allowed (the interpreter under HOME, the package in the checkout),
but never what that folder holds besides it. Carving binds the siblings of each denied path
instead of its parent, so the list is only additive binds and symlinks: bwrap and Apptainer
render the same list (`bwrap_argv`, `apptainer_argv`); `describe` prints it.

A scorer runs the policy's code as well (hidden tests import the work): `ScorerSandbox`
confines each scoring process with `scorer_allow_list` (the system, the interpreter and the
gyre package as above, its task's own directory and hidden files read-only, the scratch copy
and result folder read-write, the same carve-outs) and no network at all.

bwrap shows the carved /etc (~140 entries around the secrets) as one read-only bind of a copy
of those entries (`etc_snapshot`, kept in Gyre's cache per state of /etc): each bind costs the
kernel ~0.35 ms of CPU, charged to no process, and a sandbox of ~190 binds took 62 ms of the
machine's CPU to start, against 12 ms with /etc as one (`tools/bench_process_start.py`). A
secret is never in the copy; an allowed file changed during a process's life is seen as it
was when that process first looked.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import site
import stat
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gyre import cache
from gyre.errors import HarnessError
from gyre.harness.workspace import SYSTEM_PATH, ExecutionDir

if TYPE_CHECKING:
    from gyre.tasks.suite import Task

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""The host's operating system, read-only (bwrap; an Apptainer image brings its own)."""
ETC = Path("/etc")
"""The system folder that holds secrets: bwrap binds a snapshot of its carve (`etc_snapshot`)."""
_SNAPSHOTTING = threading.Lock()
SYSTEM_SECRETS = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
    "/etc/sudoers.d", "/etc/security/opasswd", "/etc/ssh", "/etc/ssl/private",
    "/etc/pki/tls/private", "/etc/letsencrypt", "/etc/krb5.keytab", "/etc/munge",
    "/etc/slurm/slurmdbd.conf", "/etc/NetworkManager/system-connections", "/etc/wireguard",
)  # fmt: skip
"""Secrets in the system folders (password hashes, host and TLS keys, Kerberos keytab, the
Slurm cluster's munge key): never shown, though a sandbox may run as root."""
APPTAINER_NO_MOUNT = "hostfs,bind-paths"
"""Apptainer's own mounts turned off: every host filesystem, the site's `bind path` entries."""


@dataclass(frozen=True, slots=True)
class Mount:
    """One entry of the allow-list: `path` as the harness sees it, at the same path."""

    path: Path
    kind: Literal["ro", "rw", "symlink"] = "ro"
    target: str = ""  # symlink: what the link says (as on the host)
    system: bool = False  # part of the host OS: an Apptainer image brings its own


def allow_list(
    ex: ExecutionDir, *, program: str, binds: Sequence[Path], hidden: Iterable[Path],
    hide: Iterable[Path], workspace_root: Path,
) -> list[Mount]:  # fmt: skip
    """Everything one execution's harness sees (module docstring), parents before children."""
    deny = _deny(hidden, hide, workspace_root)
    extra = [*map(Path, binds), *program_roots(Path(program))]
    own = [Mount(ex.workspace.resolve(), "rw")]
    own += [Mount(p.resolve()) for p in (ex.instruction_file, ex.feedback_file)]
    return _ordered(_system_view(extra, deny)) + own


def scorer_allow_list(
    task: Task, writable: Sequence[Path], *, hide: Iterable[Path], workspace_root: Path
) -> list[Mount]:  # fmt: skip
    """Everything a scoring process sees (`ScorerSandbox`): the system, the interpreter, the
    gyre package (its runner scripts), the task's own directory and hidden files and the
    files its scoring command names read-only, `writable` (the scratch copy, the result
    folder) read-write; every other task's hidden files, the run, its workspaces and `hide`
    carved out as from a harness's view."""
    own = task.own_hidden_paths
    deny = _deny([p for p in task.hidden_paths if p not in own], hide, workspace_root)
    named = [Path(a.partition("=")[2] or a) for a in task.scoring.command]
    task_files = [*([task.directory] if task.directory is not None else []), *own]
    task_files += [p for p in named if p.is_absolute() and p != Path("/") and p.exists()]
    mounts = _system_view([], deny)  # (own files inside the directory: `_ordered` drops them)
    mounts += [m for p in task_files for m in _root(Path(p), False, deny)]
    return _ordered(mounts) + [Mount(Path(p).resolve(), "rw") for p in writable]


@dataclass(frozen=True, slots=True)
class ScorerSandbox:
    """Confines each scoring process (`gyre.tasks.scoring.Confine`) as a harness is confined.

    Scoring runs the policy's code: hidden tests import it, a command or a reward function
    may run it. Confined, that code sees `scorer_allow_list` and no network at all, so it
    cannot rewrite its task's hidden tests, reach into the run (its trace, its other
    workspaces), read other tasks' answers or call out. What it can still do is lie about
    its own tests from inside the process that runs them (docs/tasks.md).
    """

    kind: Literal["bwrap", "apptainer"]
    workspace_root: Path  # the run's workspaces: every execution's, carved out
    hide: tuple[Path, ...] = ()  # the run directory and the folder of runs beside it
    apptainer_image: str = ""

    def __call__(
        self, argv: list[str], cwd: Path, task: Task, writable: Sequence[Path],
        env: dict[str, str],
    ) -> tuple[list[str], dict[str, str]]:  # fmt: skip
        mounts = scorer_allow_list(
            task, writable, hide=self.hide, workspace_root=self.workspace_root
        )
        if self.kind == "apptainer":
            prefix, outer = apptainer_argv(
                mounts, cwd, self.apptainer_image, env, home=cwd, network=False
            )
            return prefix + argv, outer
        return bwrap_argv(mounts, cwd, network=False) + argv, env


def _deny(hidden: Iterable[Path], hide: Iterable[Path], workspace_root: Path) -> list[Path]:
    """`denied` and the shipped suites' folders inside every gyre package."""
    packages = gyre_packages()
    return [*denied(hidden, hide, workspace_root), *(d for g in packages for d in _suite_dirs(g))]


def _system_view(extra: Sequence[Path], deny: Sequence[Path]) -> list[Mount]:
    """The system folders, the interpreter, the gyre package and `extra`, carved by `deny`."""
    roots = [
        *((Path(p), True) for p in SYSTEM_DIRS),
        *((p, False) for p in python_roots()),
        *((g, False) for g in gyre_packages()),
        *((p, False) for p in extra),
    ]
    return [m for path, system in roots for m in _root(path, system, deny)]


def denied(hidden: Iterable[Path], hide: Iterable[Path], workspace_root: Path) -> list[Path]:
    """What no allow-list entry may show (module docstring), resolved; "/" is never denied."""
    from gyre.harness.adapters import REPO_ROOT

    out = [*hidden, *hide, workspace_root, *map(Path, SYSTEM_SECRETS), Path.home()]
    if os.environ.get("HOME"):
        out.append(Path(os.environ["HOME"]))
    if (REPO_ROOT / "pyproject.toml").is_file() or (REPO_ROOT / ".git").exists():
        out.append(REPO_ROOT)  # a checkout (an installed package has neither beside it)
    resolved = dict.fromkeys(Path(p).resolve() for p in out)
    return [p for p in resolved if p != Path("/")]


def python_roots() -> list[Path]:
    """The interpreter's installation(s) and the user site-packages, when Python uses it."""
    roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else ""
    return [Path(p) for p in dict.fromkeys([*roots, user]) if p and Path(p).exists()]


def program_roots(program: Path) -> list[Path]:
    """The program (every symlink on the way to its file), its `#!` interpreter, and the
    installation prefix of each (the folder above its `bin/`; never ~/.local, which holds
    every user-installed program's data)."""
    files = [*_link_chain(program)]
    search = [str(Path(program).parent), str(Path(sys.executable).parent), *SYSTEM_PATH]
    interpreter = _shebang(files[-1], search) if files else None
    if interpreter is not None:
        files += _link_chain(interpreter)
    prefixes = [f.parent.parent for f in files if f.parent.name == "bin" and not f.is_symlink()]
    return [*files, *(p for p in prefixes if p.name != ".local")]


def _link_chain(path: Path) -> list[Path]:
    """`path`, then each file a symlink on the way leads to (absolute), ending at a real file."""
    out: list[Path] = []
    p = Path(os.path.abspath(path))
    while p.is_symlink() and p not in out and len(out) < 40:
        out.append(p)
        p = Path(os.path.normpath(p.parent / os.readlink(p)))
    if p.exists():
        out.append(p.resolve())
    return out


def _shebang(path: Path, search: Sequence[str]) -> Path | None:
    """The interpreter a `#!` script runs with (`env NAME` looked up in `search`, the
    harness's PATH)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    words = line[2:].decode(errors="replace").split()
    if not words:
        return None
    if Path(words[0]).name == "env" and len(words) > 1:
        found = shutil.which(words[-1], path=os.pathsep.join(search))
        return Path(found) if found else None
    return Path(words[0])


@functools.cache
def gyre_packages() -> tuple[Path, ...]:
    """The gyre package this process runs and the one a harness's `python -m gyre...` imports
    (asked of the interpreter from /, as a harness starts it: an editable install may point
    elsewhere than this process's working directory)."""
    import gyre

    here = Path(gyre.__file__).resolve().parent
    ask = "import importlib.util as u; s = u.find_spec('gyre'); print(s.origin if s else '')"
    env = {"PATH": os.pathsep.join(SYSTEM_PATH)}
    try:
        out = subprocess.run([sys.executable, "-c", ask], cwd="/", env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        there = Path(out.stdout.strip()).resolve().parent if out.stdout.strip() else here
    except (OSError, subprocess.TimeoutExpired):
        there = here
    return tuple(dict.fromkeys([here, there]))


def _suite_dirs(gyre: Path) -> list[Path]:
    """The folders under gyre/tasks: the shipped suites, never seen by a harness."""
    tasks = gyre / "tasks"
    if not tasks.is_dir():
        return []
    return [d for d in tasks.iterdir() if d.is_dir() and d.name != "__pycache__"]


def _root(path: Path, system: bool, deny: Sequence[Path]) -> list[Mount]:
    """One allow-list root as mounts: itself, or its pieces around what `deny` holds."""
    if not os.path.lexists(path):
        return []
    out: list[Mount] = []
    if path.is_symlink():  # keep the link (/bin -> usr/bin), and bind what it points at
        out.append(Mount(path, "symlink", os.readlink(path), system))
        if not path.exists():
            return out
    if path.resolve() in deny:  # a denied folder stays out whole, even named as a root
        return out
    return out + list(_carve(path.resolve(), deny, system))


def _carve(root: Path, deny: Sequence[Path], system: bool) -> Iterator[Mount]:
    """`root` as mounts that leave out every denied path strictly inside it: each child of
    `root` whole, but a denied one left out, a symlink kept as one, and one that holds denied
    paths carved in turn (a runner builds this list per execution: /etc alone has ~140
    children, so each is looked at once, from its directory entry)."""
    inside = [d for d in deny if d != root and d.is_relative_to(root)]
    if not inside:
        yield Mount(root, "ro", "", system)
        return
    if not root.is_dir():
        return
    denied_here: set[str] = set()
    below: dict[str, list[Path]] = {}  # child name -> the denied paths strictly under it
    for d in inside:
        first, *rest = d.relative_to(root).parts
        if rest:
            below.setdefault(first, []).append(d)
        else:
            denied_here.add(first)
    with os.scandir(root) as entries:
        children = sorted(entries, key=lambda e: e.name)
    for entry in children:
        child = root / entry.name
        if entry.name in denied_here:
            continue
        if entry.is_symlink():
            yield Mount(child, "symlink", os.readlink(child), system)
        elif entry.name in below:
            yield from _carve(child, below[entry.name], system)
        else:
            yield Mount(child, "ro", "", system)


def _ordered(mounts: list[Mount]) -> list[Mount]:
    """Parents before children, without what a bound folder shows already.

    A bound folder holds nothing denied (`_carve`), so an entry inside it (seen through its
    real parent: a link under /bin is inside /usr) would show the same host file again."""
    bound = {m.path for m in mounts if m.kind != "symlink"}
    system = {m.path for m in mounts if m.system}
    unique = {m.path: replace(m, system=m.path in system) for m in mounts}.values()
    resolved = {p: p.resolve() for p in {m.path.parent for m in unique}}  # ~140 share /etc
    kept = [m for m in unique if not _inside(resolved[m.path.parent], bound)]
    return sorted(kept, key=lambda m: (len(m.path.parts), str(m.path)))


def _inside(path: Path, folders: set[Path]) -> bool:
    return path in folders or any(p in folders for p in path.parents)


def describe(mounts: Sequence[Mount]) -> str:
    """The allow-list, one line per entry (for logs and docs)."""
    lines = []
    for m in mounts:
        what = f"-> {m.target}" if m.kind == "symlink" else m.kind
        lines.append(f"{m.path}  {what}{'  (system)' if m.system else ''}")
    return "\n".join(lines)


# ------------------------------------------------------------------ bubblewrap


def bwrap_available() -> bool:
    return shutil.which("bwrap", path=os.pathsep.join(SYSTEM_PATH)) is not None


def bwrap_works() -> str | None:
    """None when bubblewrap can start a sandbox here, else why not (one line)."""
    bwrap = shutil.which("bwrap", path=os.pathsep.join(SYSTEM_PATH))
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    started, why = _probe(
        [bwrap, "--ro-bind", "/", "/", "--proc", "/proc", "--unshare-pid", "true"], 30
    )
    if why is None:
        return None
    if not started:
        return f"bwrap did not run ({why})"
    return f"bwrap cannot create a sandbox here ({why}; it needs user namespaces)"


def _probe(argv: list[str], timeout: float) -> tuple[bool, str | None]:
    """Run a sandbox tool's smoke test: (started, None) when it exits 0, else (whether it
    started at all, why it failed: the error, or its last line of stderr)."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if out.returncode != 0:
        return True, (out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"])[0]
    return True, None


def bwrap_argv(mounts: Sequence[Mount], cwd: Path, *, network: bool = True) -> list[str]:
    """bubblewrap argv (before the program's own) that shows the program only `mounts`, run
    in `cwd`; `network=False`: in a network namespace of its own (no interface but an
    unconnected loopback)."""
    bwrap = shutil.which("bwrap", path=os.pathsep.join(SYSTEM_PATH))
    if bwrap is None:
        raise HarnessError(
            "sandbox 'bwrap' requested but bubblewrap is not installed (apt-get install bubblewrap)"
        )
    argv = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
    argv += [] if network else ["--unshare-net"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    flag = {"ro": "--ro-bind", "rw": "--bind"}
    etc = [m for m in mounts if m.path.is_relative_to(ETC) and m.path != ETC]
    snapshot = None
    if etc and all(m.system for m in etc):  # the carved /etc, not /etc bound whole
        with _SNAPSHOTTING:  # runners build argvs in threads: the first ones would each copy
            snapshot = etc_snapshot(tuple(etc))
            if snapshot is not None and not snapshot.is_dir():  # removed since
                etc_snapshot.cache_clear()
                snapshot = etc_snapshot(tuple(etc))
    parts = set(etc)
    for m in mounts:
        if snapshot is not None and m in parts:  # the copy, where its first part would go
            if m == etc[0]:
                argv += ["--ro-bind", str(snapshot), str(ETC)]
        elif m.kind == "symlink":
            argv += ["--symlink", m.target, str(m.path)]
        else:
            argv += [flag[m.kind], str(m.path), str(m.path)]
    argv += ["--remount-ro", "/", "--chdir", str(cwd), "--"]
    return argv


@functools.lru_cache(maxsize=4)
def etc_snapshot(parts: tuple[Mount, ...]) -> Path | None:
    """A copy of the carved /etc's `parts` (folders, regular files, symlinks as links; owners,
    modes and times kept), bound read-only at /etc by `bwrap_argv`; None where it cannot be
    kept (`bwrap_argv` then binds the parts one by one). What this process cannot read, and
    special files, are left out: the harness could not read them either.

    Kept in ``$GYRE_CACHE_DIR/sandbox-etc/KEY`` (default ``~/.cache/gyre``, out of every
    harness's sight), KEY a hash of what each part shows (path, kind, owner, mode, size, time,
    link target): a process looks /etc over once, a copy is made once per state of /etc and
    user, and a changed /etc gets a copy of its own. Written under a temporary name and
    renamed into place, so a process sees a whole copy or none."""
    import hashlib

    key = hashlib.sha256()
    for m in parts:
        for path in [m.path, *(_below(m.path) if m.kind == "ro" else [])]:
            st = path.lstat()
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            key.update(f"{path}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0"
                       f"{st.st_mtime_ns}\0{link}\0{m.kind}\0{m.target}\n".encode())  # fmt: skip
    entry = cache.root() / "sandbox-etc" / key.hexdigest()[:32]
    if not entry.is_dir():
        cache.keep(entry, lambda tmp: _copy_parts(parts, tmp))
    return entry if entry.is_dir() else None


def _copy_parts(parts: tuple[Mount, ...], into: Path) -> None:
    """The carved /etc's `parts` copied into the folder `into`, which stands for /etc."""
    for m in sorted(parts, key=lambda m: len(m.path.parts)):  # parents before children
        dest = into / m.path.relative_to(ETC)
        dest.parent.mkdir(parents=True, exist_ok=True)  # a folder the carve went into
        if m.kind == "symlink":
            dest.symlink_to(m.target)
        else:
            _copy(m.path, dest)
    for path in [into, *into.rglob("*")]:
        _same_stat(ETC / path.relative_to(into), path)


def _below(folder: Path) -> list[Path]:
    """Every path under `folder`, symlinks not followed; none where it cannot be listed."""
    out: list[Path] = []
    for parent, dirs, files in os.walk(folder):
        out += [Path(parent, name) for name in sorted(dirs + files)]
        dirs.sort()
    return out


def _copy(src: Path, dest: Path) -> None:
    if src.is_symlink():
        dest.symlink_to(os.readlink(src))
    elif src.is_dir():
        dest.mkdir()
        try:
            names = os.listdir(src)
        except PermissionError:
            names = []
        for name in names:
            _copy(src / name, dest / name)
    elif src.is_file():
        with contextlib.suppress(PermissionError):
            shutil.copyfile(src, dest)


def _same_stat(src: Path, dest: Path) -> None:
    """`dest` gets `src`'s owner (as root), mode and times; not as root, a folder stays
    writable by its owner, so that whoever removes the run can remove it (the harness sees
    it through a read-only bind)."""
    st = src.lstat()
    root = os.geteuid() == 0
    if root:
        os.lchown(dest, st.st_uid, st.st_gid)
    if not dest.is_symlink():
        keep = 0 if root or not dest.is_dir() else stat.S_IWUSR
        os.chmod(dest, stat.S_IMODE(st.st_mode) | keep)
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


# ------------------------------------------------------------------ Apptainer


def apptainer_program() -> str | None:
    """The apptainer binary on this process's PATH (where `module load` puts it) or the system's."""
    return shutil.which(
        "apptainer", path=os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_PATH])
    )


def apptainer_works(image: str) -> str | None:
    """None when Apptainer can run `image` here, else why not (one line)."""
    apptainer = apptainer_program()
    if apptainer is None:
        return "apptainer is not installed or not on PATH (on a cluster: module load apptainer)"
    if not image:
        return "harness.apptainer_image is not set (a local .sif image or sandbox directory)"
    if not Path(image).exists():
        return (
            f"harness.apptainer_image {image!r} does not exist (a local .sif or sandbox directory)"
        )
    probe = [apptainer, "exec", "--containall", "--no-mount", APPTAINER_NO_MOUNT, image, "true"]
    started, why = _probe(probe, 120)
    if why is None:
        return None
    if not started:
        return f"apptainer did not run ({why})"
    return f"apptainer cannot run {image!r} here ({why})"


def apptainer_argv(
    mounts: Sequence[Mount], cwd: Path, image: str, env: dict[str, str], *, home: Path,
    network: bool = True,
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """(argv before the program's own, environment of the apptainer process).

    The image brings the operating system (the `system` entries are left out); every other
    entry is bound at its own path. --containall gives a private /tmp, /dev, PID and IPC
    namespace and a clean environment: the program's variables travel as APPTAINERENV_*
    (APPTAINERENV_PATH sets PATH inside); HOME is `home` via --home, the program runs in
    `cwd`. `network=False`: `--net --network none`, a network namespace with only a
    loopback (the one network Apptainer lets an unprivileged user ask for).
    """
    apptainer = apptainer_program()
    if apptainer is None:
        raise HarnessError("sandbox 'apptainer' requested but apptainer is not on PATH")
    argv = [apptainer, "exec", "--containall", "--no-mount", APPTAINER_NO_MOUNT]
    argv += [] if network else ["--net", "--network", "none"]
    argv += ["--home", str(home), "--pwd", str(cwd)]
    for m in mounts:
        if m.system or m.kind == "symlink":
            continue
        if ":" in str(m.path) or "," in str(m.path):
            raise HarnessError(f"apptainer cannot bind {str(m.path)!r} (':' or ',' in the path)")
        argv += ["--bind", f"{m.path}:{m.path}" + (":ro" if m.kind == "ro" else "")]
    outer = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    outer |= {f"APPTAINERENV_{k}": v for k, v in env.items() if k != "HOME"}
    return [*argv, image], outer
