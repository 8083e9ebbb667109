"""Nothing a user owns is ever lost (issue 49): Gyre deletes only what it made, writes apart
from what it reads, and a write that fails is one line naming the path.

The refusals of outputs pointed at inputs (eval --out RUN/policies, report --out RUN, trace
export --out RUN, a run directory holding the model or the config, --out where nothing can
be made) are rows of the bad-input corpus (tests/test_bad_input_corpus.py). Here, each a
real `gyre` process: the evaluation of a model directory that once deleted it, a work
directory gyre did not make, a read-only run and a full disk (the input byte for byte as it
was, every file hashed before and after; one line, exit status 2). A small run directory (the run's
config, an empty trace, the tiny model saved as `policies/final` by the runtime's
`save_policy`) stands in for a finished run; one test starts a real engine. `gyre.fsafe`,
the one module every deletion and these checks go through, is tested directly below.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_cli_errors import ROOT, gyre, one_line_error

from gyre import cliargs, fsafe
from gyre.runtime.shared import checkpoint, policies


def digest(root: Path) -> dict[str, str]:
    """Every file (and symlink) under `root` -> its content's hash (its target's)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    assert out, f"{root} holds no files"
    return out


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run's directory as `gyre eval` / `report` / `trace export` read it."""
    from gyre.models import load_model
    from gyre.trajectory.store import TraceWriter

    run = tmp_path_factory.mktemp("pristine") / "run"
    run.mkdir()
    shutil.copy(ROOT / "templates" / "local.yaml", run / "config.yaml")
    with TraceWriter(run / "trace.h5", run_meta={"config": "x: 1", "model": "tiny"}):
        pass
    model, tok = load_model("tiny")
    policies.save_policy(run, "final", model, tok, version=3)
    return run


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    """This test's own copy of the run directory."""
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


@pytest.fixture
def model_dir(pristine_run: Path, tmp_path: Path) -> Path:
    """A user's Hugging Face model directory (the policy, without Gyre's marker)."""
    d = Path(shutil.copytree(pristine_run / "policies" / "final", tmp_path / "my-model"))
    (d / fsafe.MARKER).unlink(missing_ok=True)
    return d


def refused_untouched(root: Path, *args: str, needles: tuple[str, ...] = ()) -> None:
    """`gyre ARGS` ends in one line and exit 2, naming what it refused; `root` unchanged."""
    before = digest(root)
    one_line_error(gyre(*args), "does not write over", *needles)
    assert digest(root) == before


# -- each entry point, its output pointed at its input ---------------------------------------


@pytest.mark.slow
def test_eval_of_a_model_directory_leaves_the_model_as_it_was(model_dir: Path) -> None:
    """`gyre eval MODEL_DIR` once deleted the model it evaluated (`base / "/abs/path"`)."""
    before = digest(model_dir)
    done = gyre("eval", str(model_dir), "--instances", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "my-model" in done.stdout and digest(model_dir) == before
    for out in (model_dir, model_dir.parent, model_dir / "sub"):
        refused_untouched(model_dir, "eval", str(model_dir), "--out", str(out),
                          needles=(str(out), str(model_dir)))  # fmt: skip


def test_eval_never_replaces_a_work_directory_it_did_not_make(run: Path) -> None:
    """RUN_DIR/eval/final of a user (no marker) is kept: one line says why, nothing starts."""
    mine = run / "eval" / "final"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")
    before = digest(run)
    one_line_error(gyre("eval", str(run), "--instances", "1"), str(mine),
                   "gyre did not create it", "allowed: a new or empty directory")  # fmt: skip
    assert digest(run) == before


def test_trace_export_out_at_its_input_is_refused(run: Path) -> None:
    for source in (run, run / "trace.h5"):
        refused_untouched(run, "trace", "export", str(source), "--out", str(run),
                          needles=(str(run / "trace.h5"),))  # fmt: skip
    done = gyre("trace", "export", str(run), "--out", str(run / "export"))  # as documented
    assert done.returncode == 0 and (run / "export" / "executions.parquet").is_file()


# -- outputs that cannot be written: one line naming the path --------------------------------


def without_room() -> None:
    """In the child: no file may grow (a full disk's EFBIG); Python ignores SIGXFSZ."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


@pytest.fixture
def read_only_run(run: Path) -> Iterator[Path]:
    """The run directory read-only (for root, whom modes do not stop: no room to write)."""
    run.chmod(0o555)
    yield run
    run.chmod(0o755)


@pytest.mark.parametrize(
    "command",
    [
        lambda run: ["report", str(run)],
        lambda run: ["eval", str(run), "--instances", "1"],
        lambda run: ["trace", "export", str(run), "--out", str(run.parent / "tables")],
        # (a context within the token budget: no warning line beside the error)
        lambda run: [
            "run",
            "--run-dir",
            str(run.parent / "new-run"),
            "proxy.max_context_tokens=1024",
        ],
    ],
    ids=["report", "eval", "trace-export", "run"],
)
def test_a_read_only_run_or_a_full_disk_is_one_line(
    read_only_run: Path, command: Callable[[Path], list[str]]
) -> None:
    before = digest(read_only_run)
    args = command(read_only_run)
    done = subprocess.run([sys.executable, "-m", "gyre", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, preexec_fn=without_room)  # fmt: skip
    one_line_error(done, "cannot write", str(read_only_run.parent))
    after = digest(read_only_run)  # what it read is as it was (a half-written output may stay)
    assert {name: after.get(name) for name in before} == before


def test_no_space_left_on_device_is_one_line(run: Path, tmp_path: Path) -> None:
    """A real ENOSPC: the first file each command writes is /dev/full."""
    for args, first in ((["report", str(run)], "timeline.png"),
                        (["trace", "export", str(run)], "executions.parquet")):  # fmt: skip
        out = tmp_path / args[0]
        out.mkdir()
        (out / first).symlink_to("/dev/full")
        one_line_error(gyre(*args, "--out", str(out)), "cannot write", str(out), "No space left")


# -- files colleagues can read -----------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["022", "027"])
def test_checkpoints_and_policies_follow_the_umask(tmp_path: Path, mask: int) -> None:
    from gyre.models import load_model

    old = os.umask(mask)
    try:
        folder = checkpoint.begin(tmp_path, 4)
        (folder / checkpoint.CORE).write_bytes(b"weights")
        state = checkpoint.CheckpointState(version=4, updates=4, trained=(), next_group=0, t=0)
        saved = [checkpoint.commit(tmp_path, folder, state, keep=2)]
        model, tok = load_model("tiny")
        saved.append(policies.save_policy(tmp_path, "final", model, tok, version=4))
    finally:
        os.umask(old)
    for d in saved:
        assert d.stat().st_mode & 0o777 == 0o777 & ~mask, d
        assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in d.iterdir()), d


def test_a_policy_or_checkpoint_never_replaces_a_directory_gyre_did_not_write(
    tmp_path: Path,
) -> None:
    theirs = policies.policy_dir(tmp_path, "v00002")
    theirs.mkdir(parents=True)
    (theirs / policies.META).write_text('{"version": 2}')
    newer = policies.policy_dir(tmp_path, "v00003")
    newer.mkdir()
    (newer / policies.META).write_text('{"version": 3}')
    policies.prune(tmp_path, keep=1)  # v00002 is past the newest 1, but not Gyre's: kept
    assert digest(theirs) == {policies.META: hashlib.sha256(b'{"version": 2}').hexdigest()}
    final = tmp_path / checkpoint.CHECKPOINTS / "v00004"
    final.mkdir(parents=True)
    (final / "mine.txt").write_text("mine")
    state = checkpoint.CheckpointState(version=4, updates=4, trained=(), next_group=0, t=0)
    with pytest.raises(fsafe.UnsafePathError, match="gyre did not create it"):
        checkpoint.commit(tmp_path, checkpoint.begin(tmp_path, 4), state, keep=1)
    assert (final / "mine.txt").read_text() == "mine"


def test_an_older_gyres_policy_and_checkpoint_are_still_replaced_and_pruned(
    tmp_path: Path,
) -> None:
    """Written before markers existed (a resumed old run): recognised by what Gyre always
    wrote in them, so they are replaced and pruned as before."""
    old, newer = policies.policy_dir(tmp_path, "v00001"), policies.policy_dir(tmp_path, "v00002")
    for d in (old, newer):
        d.mkdir(parents=True)
        for name in policies.WRITTEN:
            (d / name).write_text("{}")
    policies.prune(tmp_path, keep=1)
    assert not old.exists() and newer.is_dir()
    final = tmp_path / checkpoint.CHECKPOINTS / "v00004"
    final.mkdir(parents=True)
    for name in (checkpoint.CORE, checkpoint.STATE):
        (final / name).write_text("old")
    state = checkpoint.CheckpointState(version=4, updates=4, trained=(), next_group=0, t=0)
    committed = checkpoint.commit(tmp_path, checkpoint.begin(tmp_path, 4), state, keep=1)
    assert fsafe.maker_of(committed) == checkpoint.MADE_BY
    assert not (committed / checkpoint.CORE).exists()  # the new one (no core saved here)


# -- gyre.fsafe ------------------------------------------------------------------------------


def test_remove_tree_removes_only_what_gyre_made(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "sub" / "f").write_text("x")
    with pytest.raises(fsafe.UnsafePathError, match=f"{theirs}: not removed"):
        fsafe.remove_tree(theirs)
    (theirs / fsafe.MARKER).write_text("gyre eval\n")  # another maker's mark is not enough
    with pytest.raises(fsafe.UnsafePathError):
        fsafe.remove_tree(theirs, "gyre policy")
    fsafe.remove_tree(theirs, "gyre eval")
    assert not theirs.exists()

    made = fsafe.make_temp_dir("t-", tmp_path)
    (made / "inner").mkdir()
    fsafe.remove_tree(made / "inner")  # inside a temporary directory it made
    fsafe.remove_tree(made)
    assert not made.exists()
    with pytest.raises(fsafe.UnsafePathError):  # forgotten once removed
        fsafe.remove_tree(made)


def test_a_removal_cut_short_leaves_a_directory_gyre_may_still_remove(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed while it removes a policy or checkpoint (pruning, replacing) leaves a
    directory the resumed run may still replace: the marker goes last, whatever the order
    the file system lists the files in (seen: a resumed run refusing `policies/v00002`)."""

    class Killed(BaseException):
        pass

    real_unlink = os.unlink
    for cut in range(1, 7):  # killed after `cut - 1` of its 6 files were removed
        d = fsafe.fresh_dir(tmp_path / f"v{cut}", "gyre policy")
        for name in ("config.json", "model.safetensors", "README.md", "tokenizer.json"):
            (d / name).write_text(name)
        (d / "sub").mkdir()
        (d / "sub" / "x").write_text("x")
        calls = [0]

        def unlink(
            path: object, *args: object, _c: list[int] = calls, _cut: int = cut, **kw: object
        ) -> None:
            _c[0] += 1
            if _c[0] == _cut:
                raise Killed
            real_unlink(path, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "unlink", unlink)
        with pytest.raises(Killed):
            fsafe.remove_tree(d, "gyre policy")
        monkeypatch.setattr(os, "unlink", real_unlink)
        assert fsafe.maker_of(d) == "gyre policy", f"cut after {cut - 1} files: marker gone"
        fsafe.remove_tree(d, "gyre policy")
        assert not d.exists()


def test_remove_tree_does_not_follow_symlinks_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("keep")
    made = fsafe.make_temp_dir("t-", tmp_path)
    (made / "link").symlink_to(outside)
    link_to_made = tmp_path / "alias"
    link_to_made.symlink_to(made)
    for path in (made / "link", made / "link" / "sub", link_to_made):
        with pytest.raises(fsafe.UnsafePathError):
            fsafe.remove_tree(path)
    fsafe.remove_tree(made)
    assert (outside / "sub" / "f").read_text() == "keep"


def test_fresh_dir_makes_reuses_or_refuses(tmp_path: Path) -> None:
    new = fsafe.fresh_dir(tmp_path / "a" / "b", "gyre eval")
    assert [p.name for p in new.iterdir()] == [fsafe.MARKER]
    (new / "old-work").write_text("x")
    assert [p.name for p in fsafe.fresh_dir(new, "gyre eval").iterdir()] == [fsafe.MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fsafe.maker_of(fsafe.fresh_dir(empty, "gyre eval")) == "gyre eval"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "f").write_text("x")
    (tmp_path / "file").write_text("x")
    for path in (theirs, tmp_path / "file", new):
        with pytest.raises(fsafe.UnsafePathError, match="gyre did not create it"):
            fsafe.fresh_dir(path, "gyre report")  # `new` is gyre eval's, not gyre report's
    assert (theirs / "f").read_text() == "x" and (tmp_path / "file").read_text() == "x"


def test_outputs_are_checked_apart_from_inputs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "policies").mkdir(parents=True)
    (run / "trace.h5").write_text("")
    alias = tmp_path / "alias"
    alias.symlink_to(run)
    inputs = {"the trace": run / "trace.h5", "the policies": run / "policies"}
    for out, how in ((run, "contains"), (run / "policies", "is"),
                     (run / "policies" / "x", "is inside"), (alias, "contains"),
                     (alias / "trace.h5", "is")):  # fmt: skip
        with pytest.raises(fsafe.UnsafePathError, match=f"--out {out} {how} the"):
            fsafe.check_outputs_apart({"--out": out}, inputs)
    for out in (run / "report", tmp_path / "run2", tmp_path / "ru"):
        fsafe.check_outputs_apart({"--out": out}, inputs)


def test_writing_names_the_path_that_could_not_be_written(tmp_path: Path) -> None:
    full = pytest.raises(fsafe.OutputError, match=f"cannot write {tmp_path}: No space left")
    with full, fsafe.writing(tmp_path):
        raise OSError(28, "No space left on device")
    denied = pytest.raises(fsafe.OutputError, match="cannot write /x/y: Permission denied")
    with denied, fsafe.writing(tmp_path):
        raise PermissionError(13, "Permission denied", "/x/y")


def test_directory_to_make_probes_what_it_can_really_make(tmp_path: Path) -> None:
    assert cliargs.directory_to_make(str(tmp_path / "new" / "dir")) == str(tmp_path / "new/dir")
    assert list(tmp_path.iterdir()) == []  # the probe left nothing behind
    with pytest.raises(Exception, match="cannot make a directory in '/proc'"):
        cliargs.directory_to_make("/proc/gyre-no-dir")


def test_safe_name_is_one_path_component() -> None:
    assert [fsafe.safe_name(t) for t in ("/abs/path", "..", "tiny:64x2", "final")] == [
        "abs-path",
        "model",
        "tiny-64x2",
        "final",
    ]


def test_a_policy_that_fails_mid_write_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publication whose write fails (here its model card, as on a full disk) raises, and
    neither a half-written policy nor its temporary directory stays beside the policies
    already there, which are untouched."""
    from gyre.models import load_model

    model, tokenizer = load_model("tiny")
    run_dir = tmp_path / "run"
    first = policies.save_policy(run_dir, policies.version_name(1), model, tokenizer, version=1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def full(*_: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(policies, "model_card", full)
    with pytest.raises(OSError, match="No space left"):
        policies.save_policy(run_dir, policies.version_name(2), model, tokenizer, version=2)
    assert [p.name for p in (run_dir / policies.POLICIES).iterdir()] == [first.name]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
