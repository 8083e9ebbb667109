"""An adversarial harness under the run's sandbox (`harness.sandbox`, default auto = bwrap).

The harness is this file's probe program, run by the proxy node's harness pool as any adapter
is (`gyre eval`, which runs the same `ExecutionHost` a training run's proxy node runs). It
tries to read and rewrite its task's hidden checker, read the run directory (the engine's
log beside the workspaces), see another execution's workspace, write outside its workspace,
see the run's other processes (engine, proxy, evaluator), call an engine directly (every
listening port of the machine, with any engine key it can find), and call its own proxy
route. The
same probes run once unconfined (`harness.sandbox=none`), where they succeed — so each
probe is shown able to detect the breach it looks for — and once sandboxed, where every
probe but the own route fails and the real checker is unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.tasks.suite import SHIPPED, named_suite

from .conftest import small_config, write_config

PROBE = r"""
import concurrent.futures, json, os, sys, urllib.error, urllib.request

HIDDEN, RUN, OWN = sys.argv[1], sys.argv[2], os.environ["GYRE_EXECUTION_ID"]
found = {}

def probe(name, attempt):
    try:
        found[name] = bool(attempt())
    except Exception as e:  # denied: the probe records how
        found[name] = False
        found[name + "_error"] = type(e).__name__

def read_checker():
    return "def " in open(HIDDEN).read()

def rewrite_checker():
    with open(HIDDEN, "a") as f:
        f.write("\n# forged\n")
    return True

def read_run_dir():
    return os.path.getsize(os.path.join(RUN, "tiny", "engine.log")) > 0

def see_other_workspaces():
    root = os.path.join(RUN, "tiny", "workspaces")
    return [d for d in os.listdir(root) if d != OWN]

def write_outside():
    with open(os.path.join(RUN, "escaped-" + OWN), "w") as f:
        f.write("x")
    return True

def write_task_file():  # the task's own files, beside its hidden checker
    with open(os.path.join(os.path.dirname(os.path.dirname(HIDDEN)), "task.yaml"), "a") as f:
        f.write("\n")
    return True

def see_processes():
    seen = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                seen.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                pass
    return [c for c in seen if b"gyre.rollout.cli" in c or b" eval" in c.replace(b"\0", b" ")]

def call_engine():  # around the proxy, with every engine key in sight (other processes' environ)
    keys = {None}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            keys |= {v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"GYRE_ENGINE_KEY=")}
    ports = set()  # every listening TCP port of the machine (the network is shared)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        ports |= {int(f[1].rsplit(":", 1)[1], 16) for f in map(str.split, lines) if f[3] == "0A"}

    def serves(port):
        for key in [None, *sorted(k for k in keys if k)]:  # a port that does not answer HTTP
            headers = {"Authorization": "Bearer " + key} if key else {}  # fast is left at once
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/model_info", headers=headers)
                if "weight_version" in json.load(urllib.request.urlopen(req, timeout=3)):
                    return True
            except urllib.error.HTTPError:
                continue  # an HTTP server: try the next key
            except Exception:
                return False  # not HTTP, or too slow: the next port
        return False

    # every port at once (beside a full suite's servers, one by one took minutes of timeouts)
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answered = dict(zip(sorted(ports), pool.map(serves, sorted(ports))))
    found["engine_ports"] = [port for port, ok in answered.items() if ok]
    return found["engine_ports"]

def own_route():
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    return urllib.request.urlopen(req, timeout=10).status == 200

for name, attempt in [("read_checker", read_checker), ("rewrite_checker", rewrite_checker),
                      ("read_run_dir", read_run_dir), ("see_other_workspaces", see_other_workspaces),
                      ("write_outside", write_outside), ("write_task_file", write_task_file),
                      ("see_processes", see_processes), ("call_engine", call_engine),
                      ("own_route", own_route)]:
    probe(name, attempt)
with open("probes.json", "w") as f:
    json.dump(found, f)
"""

# what a probe reports as done; a write also "succeeds" inside the sandbox's private empty
# directories (the hidden folder, the run directory, /tmp), so writes are judged on the files
BREACHES = ("read_checker", "read_run_dir", "see_other_workspaces", "see_processes")


def _probe_run(tmp_path: Path, sandbox: str, suite: Path, checker: Path) -> list[dict]:
    out = tmp_path / f"eval-{sandbox}"
    # the probe comes with the task's initial workspace (the sandbox hides the test's /tmp)
    (suite / "notes" / "workspace" / "probe.py").write_text(PROBE)
    cfg = small_config(tmp_path)
    cfg["harness"].update({
        "suite": str(suite), "tasks": ["notes"], "sandbox": sandbox, "adapter": "probe", "params": {},
        "adapters": {"probe": {"api": "openai",
                               "command": [sys.executable, "probe.py", str(checker), str(out)]}},
        # the probe tries every listening port of the machine (3 s each that never answers,
        # all at once): beside a full suite's servers and on a loaded machine that may outlast
        # the template's 40 s harness budget, and a probe killed before its report proves nothing
        "harness_timeout_s": 200, "overall_timeout_s": 240,
    })  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "gyre", "eval", "tiny", "--config", str(write_config(tmp_path, cfg)),
         "--instances", "2", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = sorted((out / "tiny" / "workspaces").glob("*/workspace/probes.json"))
    assert len(found) == 2, f"the probe harness did not report: {found}"
    # the run's engine (other tests' engines on this machine may take no key: not the run's)
    log = (out / "tiny" / "engine.log").read_text()
    port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", log)[1])  # type: ignore[index]
    return [{**json.loads(p.read_text()), "run_engine_port": port} for p in found]


@pytest.mark.slow
def test_every_probe_of_an_adversarial_harness_fails_in_the_sandbox(tmp_path: Path) -> None:
    # a private copy of the shipped suite: the unconfined run rewrites its checker
    suite = tmp_path / "learn"
    shutil.copytree(SHIPPED["learn"], suite)
    task = named_suite(str(suite))["notes"]
    hidden = task.hidden_paths[0]
    checker = hidden / "check_notes.py" if hidden.is_dir() else hidden
    pristine = checker.read_bytes(), (checker.parent.parent / "task.yaml").read_bytes()

    # unconfined: the probes find every breach
    free = _probe_run(tmp_path, "none", suite, checker)
    for report in free:
        assert all(report[b] for b in BREACHES) and report["own_route"], report
        assert report["run_engine_port"] in report["engine_ports"], report
    assert b"# forged" in checker.read_bytes(), "the unconfined harness could not forge"
    assert (checker.parent.parent / "task.yaml").read_bytes() != pristine[1]
    assert len(list((tmp_path / "eval-none").glob("escaped-*"))) == 2
    checker.write_bytes(pristine[0])
    (checker.parent.parent / "task.yaml").write_bytes(pristine[1])

    # sandboxed (the default): every breach fails, the own route works, nothing outside changed
    boxed = _probe_run(tmp_path, "auto", suite, checker)
    for report in boxed:
        assert not any(report[b] for b in BREACHES) and report["own_route"], report
        assert report["run_engine_port"] not in report["engine_ports"], report
    assert checker.read_bytes() == pristine[0], "the checker changed"
    assert (checker.parent.parent / "task.yaml").read_bytes() == pristine[1]
    assert not list((tmp_path / "eval-auto").glob("escaped-*")), "a harness wrote outside"
