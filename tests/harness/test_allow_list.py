"""The sandbox's allow-list (gyre/harness/sandbox.py) and its two renderings, bwrap and Apptainer.

What a harness sees is decided once, by `allow_list`; these tests read that list (no sandbox
runs here, so they hold on machines without bubblewrap or Apptainer): no shipped suite's
files, no HOME, checkout, run directory or other execution, but the interpreter, the gyre
code and the harness's own program; the Apptainer argv is the same list as `--bind`s.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.harness import Adapter, HarnessRunner
from gyre.harness import sandbox as sb
from gyre.harness.adapters import REPO_ROOT
from gyre.harness.workspace import prepare
from gyre.runtime.shared.harness import check_sandbox
from gyre.tasks.suite import SHIPPED, load_suite


def seen(path: Path, mounts: list[sb.Mount]) -> bool:
    """Whether the harness sees `path` through a bound folder or file (not a symlink entry)."""
    p = path.resolve()
    return any(m.kind != "symlink" and (p == m.path or p.is_relative_to(m.path)) for m in mounts)


# one step of building a tree: (index of an earlier directory to create it in, kind, which
# symlink target); the name is the step's number
TREE = st.lists(
    st.tuples(st.integers(0, 30), st.sampled_from(["dir", "file", "link"]), st.integers(0, 3)),
    max_size=24,
)


@settings(max_examples=80, deadline=None)
@given(steps=TREE, picks=st.lists(st.integers(0, 30), max_size=5))
def test_carving_binds_exactly_what_is_not_denied(steps, picks) -> None:
    """Every path of a tree is shown, by one bind or symlink entry, unless a denied path is it
    or holds it; a folder that holds a denied path is never bound (its other children are); a
    symlink is kept as a link; no entry lies inside another bound one. Checked against a walk
    of the whole tree."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        dirs, made = [root], []
        for i, (where, kind, target) in enumerate(steps):
            path = dirs[where % len(dirs)] / f"n{i}"
            if kind == "dir":
                path.mkdir()
                dirs.append(path)
            elif kind == "file":
                path.write_text("x")
            else:
                path.symlink_to(["..", "/etc", "nowhere", path.name][target])
            made.append(path)
        deny = [made[k % len(made)] for k in picks if made] + [root / "absent" / "n0"]
        mounts = list(sb._carve(root, deny, False))

        def shown(path: Path) -> bool:
            return any(m.path == path or (m.kind == "ro" and m.path in path.parents)
                       for m in mounts)  # fmt: skip

        for path in made:  # every path of the tree, by name (symlinks not followed)
            hidden = any(path == d or d in path.parents for d in deny)
            holds_denied = any(path in d.parents for d in deny)
            if holds_denied:
                assert not any(m.path == path for m in mounts), (path, mounts)
            else:
                assert shown(path) == (not hidden), (path, deny, mounts)
            if path.is_symlink():  # an entry of its own keeps the link: a bind shows its target
                assert all(m.kind == "symlink" for m in mounts if m.path == path), (path, mounts)
        for m in mounts:
            assert os.path.lexists(m.path) and not any(
                o.kind == "ro" and o.path in m.path.parents for o in mounts
            ), (m, mounts)
            if m.kind == "symlink":
                assert m.target == os.readlink(m.path)


@pytest.fixture
def execution(tmp_path, suite):
    task = suite["add"]
    ex = prepare(tmp_path / "run" / "workspaces", "g0-e0", task)
    prepare(tmp_path / "run" / "workspaces", "g0-e1", task)
    return ex, task, tmp_path / "run"


def test_the_allow_list_shows_the_program_and_none_of_the_secrets(execution, tmp_path):
    ex, task, run = execution
    (tmp_path / "other-run").mkdir()
    mounts = sb.allow_list(
        ex, program=sys.executable, binds=[], hidden=task.hidden_paths,
        hide=[run, tmp_path], workspace_root=run / "workspaces",
    )  # fmt: skip
    # what the harness needs: the system, its interpreter, the gyre code, its own files
    for needed in (Path("/usr/bin/env"), Path(sys.executable), Path(sys.prefix) / "lib"):
        assert seen(needed, mounts), needed
    gyre = Path(sb.__file__).resolve().parents[1]
    assert seen(gyre / "harness" / "reference_agent.py", mounts)
    assert seen(gyre / "tasks" / "suite.py", mounts)
    assert [m.kind for m in mounts[-3:]] == ["rw", "ro", "ro"]
    assert [m.path for m in mounts[-3:]] == [ex.workspace, ex.instruction_file, ex.feedback_file]
    # what it must not see: every file of every shipped suite, hidden or not
    suites = [d for d in (gyre / "tasks").iterdir() if d.is_dir() and d.name != "__pycache__"]
    assert {d.name for d in suites} >= set(SHIPPED) | {"examples"}
    files = [f for d in suites for f in d.rglob("*") if f.is_file()]
    assert any("hidden" in f.parts for f in files)
    assert not [f for f in files if seen(f, mounts)]
    for name, path in SHIPPED.items():
        for t in load_suite(path).tasks:
            assert not [h for h in t.own_hidden_paths if seen(h, mounts)], name
    # the run (config, trace, other executions), the runs beside it, HOME, the checkout
    assert not seen(run / "workspaces" / "g0-e1" / "workspace", mounts)
    assert not seen(run / "config.yaml", mounts) and not seen(tmp_path / "other-run", mounts)
    if Path.home() != Path("/"):
        home = [p for p in Path.home().iterdir() if not Path(sys.prefix).is_relative_to(p)]
        assert not [p for p in home if seen(p, mounts)]
    if (REPO_ROOT / "pyproject.toml").exists():
        assert not seen(REPO_ROOT / "pyproject.toml", mounts)
        assert not seen(REPO_ROOT / "tests", mounts) and not seen(REPO_ROOT / "runs", mounts)
    for secret in ("/etc/shadow", "/etc/ssh", "/etc/munge"):
        assert not seen(Path(secret), mounts)
    assert seen(Path("/etc/passwd"), mounts)
    # parents come before children (a child mount lands on its parent's), no repeats
    depths = [len(m.path.parts) for m in mounts[:-3]]
    assert depths == sorted(depths) and len({m.path for m in mounts}) == len(mounts)


def _tree(top: Path) -> dict[str, tuple[object, ...]]:
    """Every path under `top` (symlinks not followed), relative, with what a harness sees of
    it: its kind, owner, mode, mtime, and a link's target or a readable file's bytes."""
    out: dict[str, tuple[object, ...]] = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(folder) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                what: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode) and os.access(path, os.R_OK):
                what = path.read_bytes()
            else:
                what = stat.S_IFMT(st.st_mode)
            out[str(path.relative_to(top))] = (st.st_uid, st.st_mode, st.st_mtime_ns, what)
    return out


def test_bwrap_binds_the_carved_etc_as_one_snapshot_of_it(execution, tmp_path, monkeypatch):
    """/etc reaches the harness as one read-only bind of a copy of its allowed entries, kept in
    Gyre's cache: each path of /etc the allow-list shows is in the copy as it is on the host
    (kind, owner, mode, time, link target, bytes), and nothing else — no secret (checked
    against a walk of /etc). One copy however many argvs are built at once, reused by a later
    process, made again if removed; where the cache cannot be written, the parts one by one."""
    ex, task, run = execution
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "cache"))
    sb.etc_snapshot.cache_clear()  # this process may have kept one in another cache
    mounts = sb.allow_list(
        ex, program=sys.executable, binds=[], hidden=task.hidden_paths, hide=[run],
        workspace_root=run / "workspaces",
    )  # fmt: skip
    with ThreadPoolExecutor(4) as pool:  # a runner's first executions, built at once
        argvs = list(pool.map(lambda _: sb.bwrap_argv(mounts, ex.workspace), range(4)))
    kept = tmp_path / "cache" / "sandbox-etc"
    assert len(list(kept.iterdir())) == 1  # one copy, no half-written one left
    argv = argvs[0]
    assert all(a == argv for a in argvs)
    targets = [argv[i + 2] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind", "--symlink")]
    assert not [t for t in targets if t.startswith("/etc/")]
    bind = argv.index("/etc") - 2
    assert argv[bind] == "--ro-bind" and targets.count("/etc") == 1
    snapshot = Path(argv[bind + 1])
    assert snapshot.parent == kept
    secrets = [Path(p) for p in sb.SYSTEM_SECRETS]
    host = {p: what for p, what in _tree(Path("/etc")).items()
            if not any(s == Path("/etc", p) or s in Path("/etc", p).parents for s in secrets)}  # fmt: skip
    assert any(Path("/etc", p).exists() for p in sb.SYSTEM_SECRETS)  # there is one to leave out
    assert _tree(snapshot) == host
    assert (snapshot.stat().st_mode, snapshot.stat().st_uid) == (
        Path("/etc").stat().st_mode, Path("/etc").stat().st_uid)  # fmt: skip
    sb.etc_snapshot.cache_clear()  # a later process: the same copy, not a new one
    inode = snapshot.stat().st_ino
    assert (
        sb.bwrap_argv(mounts, ex.workspace)[bind + 1] == str(snapshot)
        and snapshot.stat().st_ino == inode
    )
    shutil.rmtree(snapshot)  # removed under a live runner: copied again
    assert (
        sb.bwrap_argv(mounts, ex.workspace)[bind + 1] == str(snapshot) and _tree(snapshot) == host
    )
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")  # no cache can be kept under it
    sb.etc_snapshot.cache_clear()
    argv = sb.bwrap_argv(mounts, ex.workspace)
    assert "/etc" not in argv and "/etc/passwd" in argv and "/etc/shadow" not in argv
    sb.etc_snapshot.cache_clear()


def test_a_program_installed_under_a_denied_folder_is_shown_without_the_rest(execution, tmp_path):
    """A harness installed under HOME or the checkout (npm prefix, a venv): its symlink,
    file, `#!` interpreter and installation prefix are bound, nothing else of that folder."""
    ex, task, run = execution
    home = tmp_path / "home"
    pkg = home / "tools" / "node_modules" / "tool"
    (pkg / "bin").mkdir(parents=True)
    script = pkg / "bin" / "tool.js"
    script.write_text("#!/usr/bin/env bash\necho hi\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    link = home / "tools" / "node_modules" / ".bin" / "tool"
    link.parent.mkdir()
    link.symlink_to("../tool/bin/tool.js")
    (home / "secret.txt").write_text("s3cret")
    roots = sb.program_roots(link)
    assert roots[:2] == [link, script] and pkg in roots
    assert any(r.name == "bash" for r in roots)
    mounts = sb.allow_list(
        ex, program=str(link), binds=[], hidden=task.hidden_paths, hide=[run, home],
        workspace_root=run / "workspaces",
    )  # fmt: skip
    assert seen(script, mounts) and seen(pkg / "bin", mounts)
    assert sb.Mount(link, "symlink", "../tool/bin/tool.js") in mounts
    assert not seen(home / "secret.txt", mounts) and not seen(home / "tools", mounts)


def fake_apptainer(tmp_path: Path, monkeypatch, status: int = 0) -> Path:
    """An `apptainer` on PATH that records its argv and environment and exits `status`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "apptainer"
    log = tmp_path / "apptainer.log"
    tool.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\nenv > {log}.env\nexit {status}\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_apptainer_argv_binds_the_same_allow_list(execution, tmp_path, monkeypatch):
    ex, task, run = execution
    fake_apptainer(tmp_path, monkeypatch)
    mounts = sb.allow_list(
        ex, program=sys.executable, binds=[], hidden=task.hidden_paths, hide=[run],
        workspace_root=run / "workspaces",
    )  # fmt: skip
    env = {"HOME": str(ex.home), "PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "key-e0"}
    argv, outer = sb.apptainer_argv(mounts, ex.workspace, "/images/gyre.sif", env, home=ex.home)
    assert argv[:9] == [
        str(tmp_path / "bin" / "apptainer"), "exec", "--containall", "--no-mount",
        "hostfs,bind-paths", "--home", str(ex.home), "--pwd", str(ex.workspace),
    ]  # fmt: skip
    assert argv[-1] == "/images/gyre.sif"
    binds = argv[10:-1:2]
    assert all(flag == "--bind" for flag in argv[9:-1:2])
    # the image brings the system; every other entry of the one list is bound, nothing else
    want = [f"{m.path}:{m.path}" + (":ro" if m.kind == "ro" else "") for m in mounts
            if not m.system and m.kind != "symlink"]  # fmt: skip
    assert binds == want and f"{ex.workspace}:{ex.workspace}" in binds
    assert not [b for b in binds if b.startswith(("/usr", "/etc"))]
    # the harness's environment travels as APPTAINERENV_* (PATH included); HOME by --home
    assert outer["APPTAINERENV_OPENAI_API_KEY"] == "key-e0"
    assert outer["APPTAINERENV_PATH"] == "/usr/bin:/bin" and "APPTAINERENV_HOME" not in outer
    assert "OPENAI_API_KEY" not in outer
    # bwrap renders the very same list (/etc's parts as one copy of them: the test above)
    bw = sb.bwrap_argv(mounts, ex.workspace) if sb.bwrap_available() else None
    if bw is not None:
        for m in mounts:
            assert str(m.path) in bw or m.path.is_relative_to("/etc"), m


def test_a_scorer_sees_its_own_task_and_scratch_copy_and_no_network(
    execution, tmp_path, monkeypatch
):
    """The scorer's list: its task's directory and hidden tests (read-only), the scratch copy
    and result folder (read-write), none of another task's hidden files, the run or another
    execution; bwrap and Apptainer both start it in a network namespace of its own."""
    ex, task, run = execution
    scratch, result = tmp_path / "scratch", tmp_path / "result"
    scratch.mkdir(), result.mkdir()
    confine = sb.ScorerSandbox("bwrap", workspace_root=run / "workspaces", hide=(run,))
    mounts = sb.scorer_allow_list(task, [scratch, result], hide=[run],
                                  workspace_root=run / "workspaces")  # fmt: skip
    assert task.directory is not None and seen(task.directory / "task.yaml", mounts)
    assert seen(Path(task.scoring.tests), mounts)
    assert seen(Path(sb.__file__).resolve().parents[1] / "tasks" / "check_runner.py", mounts)
    assert [(m.path, m.kind) for m in mounts[-2:]] == [(scratch, "rw"), (result, "rw")]
    assert [m for m in mounts if m.kind == "rw"] == mounts[-2:]
    others = [h for h in task.hidden_paths if h not in task.own_hidden_paths]
    assert others and not [h for h in others if seen(h, mounts)]
    assert not seen(ex.workspace, mounts) and not seen(run / "workspaces" / "g0-e1", mounts)
    # a scoring command's files are its own wherever they lie; "/" never opens the machine
    checker = tmp_path / "checkers" / "check.py"
    checker.parent.mkdir()
    checker.write_text("print(1)\n")
    (tmp_path / "checkers" / "other.py").write_text("")
    scoring = replace(task.scoring, rule="command", command=["python3", str(checker), "/"])
    named = sb.scorer_allow_list(replace(task, scoring=scoring), [scratch], hide=[run],
                                 workspace_root=run / "workspaces")  # fmt: skip
    assert seen(checker, named) and not seen(tmp_path / "checkers" / "other.py", named)
    assert not seen(Path.home(), named) and not seen(tmp_path / "other-run", named)
    env = {"HOME": str(scratch), "PATH": "/usr/bin:/bin"}
    if sb.bwrap_available():
        argv, _ = confine(["python3", "x.py"], scratch, task, [scratch, result], env)
        assert "--unshare-net" in argv and argv[-2:] == ["python3", "x.py"]
        assert argv[argv.index("--chdir") + 1] == str(scratch)
    fake_apptainer(tmp_path, monkeypatch)
    boxed = sb.ScorerSandbox("apptainer", workspace_root=run / "workspaces", hide=(run,),
                             apptainer_image="/images/gyre.sif")  # fmt: skip
    argv, outer = boxed(["python3", "x.py"], scratch, task, [scratch, result], env)
    assert outer["APPTAINERENV_PATH"] == "/usr/bin:/bin" and "APPTAINERENV_HOME" not in outer
    assert argv[4:13] == ["hostfs,bind-paths", "--net", "--network", "none", "--home",
                          str(scratch), "--pwd", str(scratch), "--bind"]  # fmt: skip
    assert f"{scratch}:{scratch}" in argv and f"{result}:{result}" in argv
    assert argv[-3:] == ["/images/gyre.sif", "python3", "x.py"]


def test_a_runner_with_the_apptainer_sandbox_starts_the_harness_through_apptainer(
    make_runner, spec_for, tmp_path, monkeypatch
):
    log = fake_apptainer(tmp_path, monkeypatch)
    image = tmp_path / "gyre.sif"
    image.write_text("")
    runner = make_runner(sandbox="apptainer", apptainer_image=str(image))
    term = asyncio.run(runner.run(spec_for("echo hi", execution_id="a1")))
    assert term.outcome.value == "completed" and runner.events[0].sandbox == "apptainer"
    argv = log.read_text().splitlines()
    cut = argv.index(str(image))
    assert argv[:2] == ["exec", "--containall"] and argv[cut + 2 :] == ["-c", "echo hi"]
    assert Path(argv[cut + 1]).name == "bash"
    env = dict(line.split("=", 1) for line in Path(f"{log}.env").read_text().splitlines()
               if "=" in line)  # fmt: skip
    assert env["APPTAINERENV_OPENAI_API_KEY"] == "key-a1" and "OPENAI_API_KEY" not in env


def test_gyre_refuses_a_sandbox_that_cannot_run_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no apptainer anywhere on it
    monkeypatch.setattr(sb, "SYSTEM_PATH", (str(tmp_path),))
    with pytest.raises(ConfigError) as e:
        check_sandbox("apptainer", "/images/gyre.sif")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("harness.sandbox: apptainer: apptainer is not")
    assert "allowed: Apptainer with harness.apptainer_image" in msg
    assert "harness.sandbox=bwrap" in msg and "harness.sandbox=none" in msg
    fake_apptainer(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match=r"harness\.apptainer_image is not set"):
        check_sandbox("apptainer", "")
    with pytest.raises(ConfigError, match=r"'/no/such\.sif' does not exist"):
        check_sandbox("apptainer", "/no/such.sif")
    (tmp_path / "gyre.sif").write_text("")
    check_sandbox("apptainer", str(tmp_path / "gyre.sif"))  # the probe exits 0: accepted
    fake_apptainer(tmp_path, monkeypatch, status=255)
    with pytest.raises(ConfigError, match="apptainer cannot run"):
        check_sandbox("apptainer", str(tmp_path / "gyre.sif"))
    with pytest.raises(ConfigError, match="apptainer_image: must be set"):
        HarnessRunner.Config(workspace_root=str(tmp_path), sandbox="apptainer")
    check_sandbox("none", "")


def test_builtin_adapters_bind_their_installations():
    from gyre.harness import builtin_adapters

    adapters = builtin_adapters()
    for name in ("claude_code", "claude_code_bare", "codex"):
        assert adapters[name].sandbox_paths() == [REPO_ROOT / ".tools" / "node_modules"]
    assert adapters["mini_swe_agent"].sandbox_paths() == [REPO_ROOT / ".tools" / "mini-swe-agent"]
    custom = Adapter(name="x", api="openai", command=["x"], sandbox_binds=["/opt/x"])
    assert custom.sandbox_paths() == [Path("/opt/x")]
