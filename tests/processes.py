"""The processes of one `gyre run`, found in /proc by what they carry (tests only).

Ranks carry the run directory on their command line and PMI_RANK in their environment (a
rank forked by `gyre run`'s rank zygote is named ``gyre-rank-<rank>``; the process mpiexec
started for it, which carries both, is its ``enter``);
engines carry GYRE_RUN_DIR / GYRE_ENGINE_INDEX, or, forked by their rank's zygote (whose
command line and environment they keep), the name ``gyre-engine-<index>``; harnesses and scorers carry the run's
workspace paths on their command line. A kill test finds its victim here and, afterwards,
checks by pid that it is really gone.

Also where a test's own torch.distributed world meets (`rendezvous`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    kind: str  # rank | enter | engine | zygote | harness | scorer | other
    index: int  # world rank, engine index, or -1
    cmdline: str


def _read(pid: str) -> tuple[list[bytes], dict[bytes, bytes], str] | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if state == "Z":
        return None  # a zombie has already died
    env = dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)
    return cmd, env, name


def scan(run_dir: Path) -> list[Proc]:
    """Every live process of the run at `run_dir`."""
    mark = str(run_dir.resolve()).encode()
    mark_rel = str(run_dir).encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        got = _read(entry.name)
        if got is None:
            continue
        cmd, env, name = got
        joined = b" ".join(cmd)
        mine = mark in joined or mark_rel in joined or env.get(b"GYRE_RUN_DIR") == mark
        if not mine or any(c.endswith(b"mpiexec") for c in cmd[:1]):
            continue
        out.append(_classify(int(entry.name), joined, env, name))
    return out


def _classify(pid: int, joined: bytes, env: dict[bytes, bytes], name: str) -> Proc:
    text = joined.decode(errors="replace")
    if name.startswith("gyre-engine-"):  # forked by a zygote (gyre.zygote)
        return Proc(pid, "engine", int(name.rsplit("-", 1)[1]), text)
    if name.startswith("gyre-rank-"):  # forked by gyre run's rank zygote
        return Proc(pid, "rank", int(name.rsplit("-", 1)[1]), text)
    if name == "gyre-zygote":
        return Proc(pid, "zygote", -1, text)
    if b"-m gyre.zygote gyre.runtime.main" in joined and b"PMI_RANK" in env:
        return Proc(pid, "enter", int(env[b"PMI_RANK"]), text)  # mpiexec's; the rank: its fork
    if b"gyre.runtime.main" in joined and b"PMI_RANK" in env:
        return Proc(pid, "rank", int(env[b"PMI_RANK"]), text)
    if b"gyre.rollout.cli" in joined and b"GYRE_ENGINE_INDEX" in env:
        return Proc(pid, "engine", int(env[b"GYRE_ENGINE_INDEX"]), text)
    if b"reference_agent" in joined:
        return Proc(pid, "harness", -1, text)
    if b"check_" in joined or b"slow_score" in joined:
        return Proc(pid, "scorer", -1, text)
    return Proc(pid, "other", -1, text)


def wait_for(
    run_dir: Path, kind: str, index: int = -1, timeout: float = 240, exclude: Iterable[int] = ()
) -> Proc:
    """The first live process of `kind` (and `index`, not in `exclude`), polling until it exists."""
    deadline = time.monotonic() + timeout
    skip = set(exclude)
    while time.monotonic() < deadline:
        for p in scan(run_dir):
            if p.kind == kind and (index < 0 or p.index == index) and p.pid not in skip:
                return p
        time.sleep(0.05)
    raise AssertionError(f"no {kind} {index} of {run_dir} within {timeout}s")


def age(pid: int) -> float:
    """Seconds since process `pid` started (infinite once it is gone)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return float("inf")
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def child_of(pid: int) -> int | None:
    """A live child process of `pid` (a rank's engine, say), if any."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            return int(entry.name)
    return None


def pids_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker`."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        got = _read(entry.name)
        if got is not None and marker.encode() in b" ".join(got[0]):
            out.append(int(entry.name))
    return out


def all_gone(pids: set[int] | list[int], timeout: float = 10) -> bool:
    return gone(list(pids), timeout)


def gone(pids: list[int], timeout: float = 30) -> bool:
    """True once none of `pids` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_read(str(p)) is None for p in pids):
            return True
        time.sleep(0.1)
    return False


def rendezvous(folder: Path) -> str:
    """The init URL of a test's own torch.distributed world: a file store in a new folder under
    `folder`. No port is picked and then bound later, so no other process on the machine can
    take it in between (EADDRINUSE on a busy machine)."""
    return f"file://{tempfile.mkdtemp(prefix='rendezvous-', dir=folder)}/store"
