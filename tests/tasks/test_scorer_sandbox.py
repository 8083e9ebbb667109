"""Scoring runs the policy's code, confined as its harness was (`ScorerSandbox`).

Hidden tests import the work, a command may run it, a reward function may import it: each
rule's scoring process runs code the policy wrote. Through the runtime's `ExecutionHost` (what
a run's proxy node and `gyre eval` run), one task per rule scores a workspace whose module,
when imported, tries to rewrite its task's hidden tests and task file, read another task's
hidden file, write into the run directory and into another execution's workspace, call a
server on the machine, and leave an atexit hook that rewrites the runner's verdict. Once
unconfined (`harness.sandbox=none`), where every breach lands — so each probe is shown able
to find what it looks for — but the verdict's (the runners exit as soon as they wrote it),
and once under the default sandbox, where none does and every rule still scores the work
as it is.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from gyre.tasks.evaluator import Validity

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import atexit, json, os, re, socket, sys

P = json.loads(%r)
REPORT = {}


def attempt(name, fn):
    try:
        REPORT[name] = bool(fn())
    except Exception:
        REPORT[name] = False


def append(path, text):
    with open(path, "a") as f:
        f.write(text)
    return True


def escape():
    with open(os.path.join(P["run"], "escaped-" + P["rule"]), "w") as f:
        f.write("x")
    return True


attempt("rewrite_hidden", lambda: append(P["hidden"], "\n# forged\n"))
attempt("write_task_file", lambda: append(P["task_file"], "\n"))
attempt("read_other_task", lambda: "ANSWER" in open(P["secret"]).read())
attempt("write_run_dir", escape)
attempt("write_other_workspace", lambda: append(P["other"], "forged"))
attempt("call_server", lambda: socket.create_connection(("127.0.0.1", P["port"]), 3).close() or 1)


def forge():  # after the runner wrote its verdict: every test passed
    args = sys.argv
    if "--result" in args:
        path = args[args.index("--result") + 1]
        data = json.load(open(path))
        data["results"] = dict.fromkeys(data["results"], "pass")
        data["passed"] = data["total"]
        json.dump(data, open(path, "w"))
    if "--junitxml" in args:
        path = args[args.index("--junitxml") + 1]
        text = re.sub(r"<failure.*?</failure>|<failure[^>]*/>", "", open(path).read(), flags=re.S)
        open(path, "w").write(text)


atexit.register(forge)


def ok():
    return True
"""

HIDDEN_TESTS = """\
from solution import ok


def test_passes():
    assert ok()


def test_fails():
    assert not ok()
"""

REWARD = """\
import sys


def score(workspace, data):
    sys.path.insert(0, str(workspace))
    import solution  # the work's own module: its probes run here

    return {"score": 0.5, "detail": {"report": solution.REPORT}}
"""

COMMAND = "import json, solution; print(json.dumps(solution.REPORT)); print(0.5)"
RULES = {
    "hidden_tests": {"rule": "hidden_tests", "tests": "hidden/test_probe.py"},
    "tests": {"rule": "tests", "tests": "hidden",
              "fail_to_pass": ["tests/test_probe.py::test_passes",
                               "tests/test_probe.py::test_fails"]},
    "python": {"rule": "python", "function": "hidden/reward.py:score"},
    "command": {"rule": "command", "command": ["python3", "-c", COMMAND]},
}  # fmt: skip
HIDDEN_FILE = {
    "hidden_tests": "hidden/test_probe.py", "tests": "hidden/tests/test_probe.py",
    "python": "hidden/reward.py", "command": "task.yaml",
}  # fmt: skip


def _suite(root: Path) -> Path:
    """A suite of one task per rule, and one more whose hidden answer no scorer may read."""
    suite = root / "suite"
    for name, scoring in RULES.items():
        task = suite / name
        (task / "workspace").mkdir(parents=True)
        (task / "workspace" / "README.md").write_text("Write solution.py.\n")
        (task / "hidden" / "tests").mkdir(parents=True)
        (task / "hidden" / "test_probe.py").write_text(HIDDEN_TESTS)
        (task / "hidden" / "tests" / "test_probe.py").write_text(HIDDEN_TESTS)
        (task / "hidden" / "reward.py").write_text(REWARD)
        spec = {"instruction": "Write solution.py.", "difficulty": "easy",
                "scoring": {**scoring, "timeout_s": 60, "per_test_timeout_s": 10}}  # fmt: skip
        (task / "task.yaml").write_text(yaml.safe_dump(spec))
    other = suite / "other"
    (other / "workspace").mkdir(parents=True)
    (other / "hidden").mkdir()
    (other / "hidden" / "answer.txt").write_text("ANSWER 42\n")
    (other / "task.yaml").write_text(yaml.safe_dump({
        "instruction": "Say the answer.", "difficulty": "easy",
        "scoring": {"rule": "command", "command": ["grep", "-q", "42", "answer.txt"]},
    }))  # fmt: skip
    return suite


class _Listener:
    """A TCP server on loopback that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


def _score_all(
    tmp_path: Path, sandbox: str, port: int, terminated: Any
) -> tuple[dict[str, Any], Path]:
    """Every rule's task scored once on the probing work, under `sandbox`: (rule -> its
    assessment, the suite the scorers were given)."""
    from gyre.runtime.proxy_node.node import ExecutionHost
    from gyre.runtime.shared.config import load_run_config

    root = tmp_path / sandbox
    suite = _suite(root)
    cfg = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    cfg["harness"].update({"suite": str(suite), "tasks": list(RULES), "sandbox": sandbox,
                           "eval_attempts": 1})  # fmt: skip
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = root / "run"
    host = ExecutionHost(load_run_config(root / "run.yaml"), run_dir)
    other = run_dir / "workspaces" / "other-0" / "workspace" / "notes.md"
    other.parent.mkdir(parents=True)
    other.write_text("mine\n")
    out: dict[str, Any] = {}
    for rule in RULES:
        task = host.suite[rule]
        workspace = run_dir / "workspaces" / f"{rule}-0" / "workspace"
        workspace.mkdir(parents=True)
        params = {
            "rule": rule, "hidden": str(suite / rule / HIDDEN_FILE[rule]),
            "task_file": str(suite / rule / "task.yaml"),
            "secret": str(suite / "other" / "hidden" / "answer.txt"), "run": str(run_dir),
            "other": str(other), "port": port,
        }  # fmt: skip
        (workspace / "solution.py").write_text(PROBE % json.dumps(params))
        verdict = asyncio.run(host.evaluator.assess(terminated(workspace, budget_s=120), task))
        out[rule] = verdict.assessment
    return out, suite


def test_scoring_the_policys_code_reaches_nothing_outside_its_scratch_copy(
    tmp_path: Path, make_terminated: Any
) -> None:
    server = _Listener()
    try:
        free, free_suite = _score_all(tmp_path, "none", server.port, make_terminated)
        reached = server.accepted
        boxed, boxed_suite = _score_all(tmp_path, "auto", server.port, make_terminated)
    finally:
        server.close()

    # unconfined: every probe lands (each can find the breach it looks for)
    assert all(a.validity is Validity.VALID for a in free.values()), free
    report = json.loads(free["command"].detail["stdout_tail"].splitlines()[-2])
    assert all(report.values()), report
    assert free["python"].detail["report"] == report
    for rule in RULES:
        assert "# forged" in (free_suite / rule / HIDDEN_FILE[rule]).read_text(), rule
        assert (tmp_path / "none" / "run" / f"escaped-{rule}").is_file(), rule
    assert reached == len(RULES)
    notes = tmp_path / "none" / "run" / "workspaces" / "other-0" / "workspace" / "notes.md"
    assert notes.read_text() == "mine\n" + "forged" * len(RULES)
    # ... but the verdict its atexit hook rewrote: the runners exit as soon as they wrote it
    assert (free["hidden_tests"].score, free["tests"].score) == (0.5, 0.5)

    # sandboxed (the default): every rule scores the work as it is, and no probe lands
    assert {r: (a.validity, a.score) for r, a in boxed.items()} == {
        r: (Validity.VALID, 0.5) for r in RULES
    }, {r: a.error for r, a in boxed.items()}
    report = json.loads(boxed["command"].detail["stdout_tail"].splitlines()[-2])
    assert report == dict.fromkeys(report, False) and len(report) == 6, report
    assert boxed["python"].detail["report"] == report
    pristine = _suite(tmp_path / "pristine")
    for rule in RULES:
        for f in (HIDDEN_FILE[rule], "task.yaml"):
            assert (boxed_suite / rule / f).read_bytes() == (pristine / rule / f).read_bytes()
    assert not list((tmp_path / "auto" / "run").glob("escaped-*"))
    assert server.accepted == reached, "a confined scorer called a server on the machine"
    notes = tmp_path / "auto" / "run" / "workspaces" / "other-0" / "workspace" / "notes.md"
    assert notes.read_text() == "mine\n"


def test_the_work_cannot_customize_the_python_a_scorer_starts(tmp_path: Path) -> None:
    """A scorer's HOME is the scratch copy, so the work's own `.local/.../usercustomize.py`
    would run inside every `python3` a command rule starts (outside a virtual environment,
    where Python reads the user's site-packages): the scoring environment turns it off."""
    from gyre.tasks.scoring import run_limited, scoring_env
    from gyre.tasks.suite import load_suite

    python = str(Path(sys.base_prefix) / "bin" / "python3")  # not a venv's: it reads the user site
    ask = [python, "-c", "import site; print(site.USER_SITE)"]
    site = Path(subprocess.check_output(ask, env={"HOME": str(tmp_path)}, text=True).strip())
    site.mkdir(parents=True)
    (site / "usercustomize.py").write_text("print('customized')\n")
    argv = [python, "-c", "print('scored')"]
    env = {k: v for k, v in scoring_env(tmp_path).items() if k != "PYTHONNOUSERSITE"}
    control = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert control.stdout.split() == ["customized", "scored"], "the probe cannot customize"
    task = load_suite(ROOT / "gyre" / "tasks" / "builtin")["add"]
    rc, out, err = asyncio.run(run_limited(argv, tmp_path, 30, task))
    assert (rc, out.split()) == (0, ["scored"]), err
