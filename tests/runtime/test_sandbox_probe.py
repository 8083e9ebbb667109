"""An adversarial harness inside a real, default `gyre run` finds nothing it must not see.

The harness is a probe program configured as a run's own adapter (`harness.adapters`), as a
user configures any harness; the run keeps its default sandbox (`harness.sandbox: auto`). From
inside, the probe tries to read every file of the installed suites (hidden checkers, answers)
at the real package path, the run's own directory (config, trace, other executions), another
run beside it, the fake HOME the run was started with and the machine's real HOME, the
checkout, the system's password hashes; it lists those folders, looks for the run's other
processes and for an engine key in its environment, calls every listening port of the machine
as an engine without the engine key, and writes outside its workspace. Each success is a
breach; the test asserts none, and that the probe did run: it read its own instruction,
called its own proxy route, and the run's engine port was among the ports it tried.

The run lives under /var/tmp, not the test's /tmp (which the sandbox replaces by a private
one anyway), so the other run, HOME and the written files are where a real run's would be.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gyre.harness.adapters import REPO_ROOT

from .conftest import small_config, write_config

PROBE = r"""
import base64, json, os, sys, urllib.error, urllib.request

instruction_file, model, T = sys.argv[2], sys.argv[3], json.loads(base64.b64decode(sys.argv[4]))
own = os.environ["GYRE_EXECUTION_ID"]
report = {"breaches": {}, "denied": {}, "tried": 0}

def attempt(name, fn):
    report["tried"] += 1
    try:
        got = fn()
    except Exception as e:  # denied: how
        report["denied"][name] = type(e).__name__
        return
    if got:
        report["breaches"][name] = repr(got)[:200]
    else:
        report["denied"][name] = "nothing"

def read(path):
    with open(path, "rb") as f:
        return "read %d bytes" % len(f.read(4096))

def listing(path, allowed):  # what it shows beyond the way to the own workspace
    return sorted(set(os.listdir(path)) - {a.replace("EID", own) for a in allowed})

def write(path):
    with open(path, "w") as f:
        f.write("escaped " + own)
    return "wrote (inside the sandbox)"

def processes():
    seen = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = open("/proc/%s/cmdline" % pid, "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if any(m in cmd for m in (b"gyre.runtime", b"gyre.rollout", b"mpiexec", b"hydra_pmi")):
                seen.append(cmd[:120].decode(errors="replace"))
    return seen

def secrets_in_environment():
    return [k for k in os.environ if "ENGINE_KEY" in k or "ADMIN" in k or k == "GYRE_RUN_SECRET"]

def listening_ports():
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        ports |= {int(f[1].rsplit(":", 1)[1], 16) for f in map(str.split, lines) if f[3] == "0A"}
    return sorted(ports)

def call_engine(port):  # the engine's routes, without the engine key
    answered = []
    for path, body in (("/model_info", None),
                       ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                text = r.read(2000).decode(errors="replace")
        except urllib.error.HTTPError:
            continue  # refused (401 without the key) or not this route
        if "weight_version" in text or "output_ids" in text or "meta_info" in text:
            answered.append(path)
    return answered

def own_route():
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status

report["instruction"] = open(instruction_file).read()[:300]
for group, paths in T["read"].items():
    for p in paths:
        attempt("read %s %s" % (group, p), lambda p=p: read(p))
for name, (path, allowed) in T["list"].items():
    attempt("list %s %s" % (name, path), lambda path=path, allowed=allowed: listing(path, allowed))
for pattern_root in T["glob"]:
    def hidden_files(root=pattern_root):
        return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if "hidden" in d]
    attempt("glob hidden under %s" % pattern_root, hidden_files)
for p in T["write"]:
    attempt("write %s" % p, lambda p=p: write(p.replace("EID", own)))
attempt("processes of the run", processes)
attempt("secrets in the environment", secrets_in_environment)
report["ports_tried"] = listening_ports()
for port in report["ports_tried"]:
    attempt("engine without key :%d" % port, lambda port=port: call_engine(port))
report["own_route"] = own_route()
if own.rsplit("e", 1)[-1] in ("0", "2", "4", "6"):  # rewards differ within a group: it trains
    for k in (1, 2):
        open("note%d.md" % k, "w").write("- a note of the probe number %d\n" % k)
report["writes_inside_sandbox"] = sorted(k for k in report["breaches"] if k.startswith("write "))
for k in report["writes_inside_sandbox"]:  # a write counts once seen outside (the test checks)
    del report["breaches"][k]
json.dump(report, open("probes.json", "w"), indent=1)
print(json.dumps(report))
"""

BOOT = "import base64, sys; exec(base64.b64decode(sys.argv[1]))"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _suite_files() -> tuple[list[str], list[str]]:
    """Every file of every suite shipped in the installed package, and the suite folders."""
    import gyre

    tasks = Path(gyre.__file__).resolve().parent / "tasks"
    suites = [d for d in tasks.iterdir() if d.is_dir() and d.name != "__pycache__"]
    files = sorted(str(f) for d in suites for f in d.rglob("*") if f.is_file())
    return files, [str(d) for d in suites]


def _targets(base: Path, run_dir: Path, home: Path) -> dict:
    real_home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    home_files = [str(p) for p in sorted(real_home.iterdir()) if p.is_file()][:20]
    files, suites = _suite_files()
    other = base / "runs" / "other-run"
    return {
        "read": {
            "suite": files,
            "home": [str(home / ".secret"), *home_files],
            "checkout": [str(REPO_ROOT / n) for n in ("pyproject.toml", "README.md", ".git/HEAD")],
            "other-run": [
                str(other / "config.yaml"),
                str(other / "workspaces/g0-e0/workspace/answer.txt"),
            ],
            "own-run": [str(run_dir / n) for n in ("config.yaml", "trace.h5", "summary.json")],
            "system": ["/etc/shadow"],
        },
        "list": {
            "own run": [str(run_dir), ["workspaces"]],
            "workspaces": [str(run_dir / "workspaces"), ["EID"]],
            "runs": [str(base / "runs"), [run_dir.name]],
            "home": [str(home), []],
            "real home": [str(real_home), [p.name for p in _ancestors_of_prefix(real_home)]],
            "checkout": [str(REPO_ROOT), ["gyre"]],
        },
        "glob": suites,
        "write": [
            str(base / "outside" / "escape-EID"),
            str(base / "runs" / "escape-EID"),
            str(home / "escape-EID"),
            str(run_dir / "escape-EID"),
            f"/tmp/gyre-probe-{base.name}-EID",
        ],
    }


def _ancestors_of_prefix(folder: Path) -> list[Path]:
    """The entries of `folder` on the way to the interpreter (the sandbox shows those)."""
    prefix = Path(sys.prefix).resolve()
    return [p for p in folder.iterdir() if prefix.is_relative_to(p.resolve())]


def _config(tmp_path: Path, base: Path, targets: dict) -> Path:
    cfg = small_config(tmp_path, steps=1)
    cfg["runs_dir"] = str(base / "runs")
    cfg["topology"]["cells"] = 1
    cfg["schedule"].update(group_size=2, batch_groups=1, concurrency_per_cell=2, phi=0.0, mu=1)
    cfg["harness"].update({
        "adapter": "probe", "params": {}, "tasks": ["notes"], "harness_timeout_s": 120,
        "overall_timeout_s": 150,
        "adapters": {"probe": {"api": "openai", "command": [
            sys.executable, "-c", BOOT, _b64(PROBE), "{instruction_file}", "{model}",
            _b64(json.dumps(targets))]}},
    })  # fmt: skip
    assert "sandbox" not in cfg["harness"], "the run keeps the default sandbox"
    return write_config(tmp_path, cfg)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_probe_harness_in_a_default_gyre_run_breaches_nothing(tmp_path: Path) -> None:
    base = Path("/var/tmp") / f"gyre-probe-{uuid.uuid4().hex[:10]}"
    try:
        run_dir = base / "runs" / "probe-run"
        other = base / "runs" / "other-run"
        (other / "workspaces" / "g0-e0" / "workspace").mkdir(parents=True)
        (other / "config.yaml").write_text("secret: other-run-config\n")
        (other / "workspaces" / "g0-e0" / "workspace" / "answer.txt").write_text("42\n")
        home = base / "home"
        home.mkdir()
        (home / ".secret").write_text("secret-of-the-home\n")
        (base / "outside").mkdir()
        targets = _targets(base, run_dir, home)
        env = {**os.environ, "HOME": str(home), "GYRE_RUN_SECRET": "not-for-harnesses"}
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "gyre", "run", str(_config(tmp_path, base, targets)),
             "--run-dir", str(run_dir), "--quiet"],
            capture_output=True, text=True, timeout=420, env=env,
        )  # fmt: skip
        wall = time.monotonic() - t0
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        reports = {p.parent.parent.name: json.loads(p.read_text())
                   for p in sorted(run_dir.glob("workspaces/*/workspace/probes.json"))}  # fmt: skip
        assert len(reports) >= 2, f"the probe harness did not report: {sorted(reports)}"
        engine_ports = _engine_ports(run_dir)
        assert engine_ports, "no engine port in the run's logs"
        for eid, r in reports.items():
            # it ran, inside the run: its instruction, its own route, the run's engine in sight
            assert "Take notes on" in r["instruction"] and r["own_route"] == 200, r
            assert set(engine_ports) <= set(r["ports_tried"]), (engine_ports, r["ports_tried"])
            assert r["tried"] >= len(targets["read"]["suite"]) + 10, r["tried"]
            # a keyless engine of another program on this machine is not the run's: left out
            breaches = {k: v for k, v in r["breaches"].items() if _of_the_run(k, engine_ports)}
            assert not breaches, f"{eid}: {json.dumps(breaches, indent=1)}"
        escaped = [p.replace("EID", eid) for p in targets["write"] for eid in reports]
        assert not [p for p in escaped if Path(p).exists()], "a harness wrote outside"
        assert (other / "config.yaml").read_text() == "secret: other-run-config\n"
        n = sum(r["tried"] for r in reports.values())
        print(f"\n{len(reports)} probe harnesses, {n} probes, 0 breaches, gyre run {wall:.0f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _of_the_run(probe: str, engine_ports: list[int]) -> bool:
    """Whether a probe's finding concerns this run (an engine port: one of the run's)."""
    port = re.fullmatch(r"engine without key :(\d+)", probe)
    return port is None or int(port[1]) in engine_ports


def _engine_ports(run_dir: Path) -> list[int]:
    """The ports the run's engines listened on (their logs say)."""
    ports = set()
    for log in run_dir.rglob("*.log"):
        if "workspaces" in log.parts:
            continue
        text = log.read_text(errors="replace")
        ports |= {int(p) for p in re.findall(r"listening on http://[\d.]+:(\d+)", text)}
    return sorted(ports)
