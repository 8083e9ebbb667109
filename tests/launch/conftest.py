"""Fixtures of the launch tests: a real local Slurm cluster and a big test-only controller.

`slurm_cluster` (session) runs `bash tools/slurm_local.sh start 6 2` — munged, slurmctld and
six slurmd "nodes" n1..n6 on 127.0.0.1 (a heterogeneous job needs its coordinator, proxy and
three cells on different nodes) — and always stops it at teardown. `big_controller` (session)
starts a second slurmctld on its own port and state folder that declares 200 powered-down
cloud nodes with 128 CPUs and 8 GPUs each, so `sbatch --test-only` can judge the paper-sized
templates; it runs no slurmd and is stopped by its pid.

Every wait is bounded and polls with backoff; failures carry the job's log tail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODES, CPUS = 6, 2
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@dataclass
class SlurmCluster:
    """Environment that points Slurm's clients at one controller."""

    conf: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.pop("SLURM_JOB_ID", None)
        env.update(extra)
        return env

    def run(self, *cmd: str, timeout: float = 60, check: bool = True, **kw: object):
        """Run a Slurm client (or any command) against this cluster, killed after `timeout`."""
        env = kw.pop("env", None) or self.env()
        out = subprocess.run(
            ["timeout", "-s", "KILL", str(int(timeout)), *cmd],
            capture_output=True,
            text=True,
            env=env,
            **kw,  # type: ignore[arg-type]
        )
        if check and out.returncode:
            raise AssertionError(f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False, timeout=20)
        for line in out.stdout.splitlines():
            if "HetJobOffset=" in line and "HetJobOffset=0" not in line:
                continue
            m = re.search(r"JobState=(\S+)", line)
            if m:
                return m.group(1)
        return "GONE"

    def wait_state(
        self, job_id: str, states: tuple[str, ...], timeout: float, log: Path | None = None
    ) -> str:
        """Poll until the job reaches one of `states` (or a final state)."""
        deadline, delay = time.monotonic() + timeout, 0.3
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states or state in FINAL:
                return state
            time.sleep(delay)
            delay = min(delay * 1.4, 3.0)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} still {state} after {timeout:.0f}s\n{tail(log)}")


def tail(path: Path | None, n: int = 3000) -> str:
    if path is None or not path.exists():
        return f"(no log at {path})"
    return path.read_text(errors="replace")[-n:]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if shutil.which("bash") is None:
        pytest.fail("bash is required")
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, GYRE_SLURM_DIR=str(state))
    script = str(ROOT / "tools" / "slurm_local.sh")
    start = subprocess.run(
        ["timeout", "-s", "KILL", "240", "bash", script, "start", str(NODES), str(CPUS)],
        env=env,
        capture_output=True,
        text=True,
    )
    try:
        if start.returncode:
            pytest.fail(f"local Slurm did not start:\n{start.stderr[-3000:]}")
        yield SlurmCluster(conf=state / "slurm.conf")
    finally:
        subprocess.run(
            ["timeout", "-s", "KILL", "60", "bash", script, "stop"],
            env=env,
            capture_output=True,
        )


BIG_CONF = """\
ClusterName=gyrebig
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={port}
SlurmdPort={port2}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmctldLogFile={dir}/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
PrivateData=cloud
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=600
ResumeTimeout=600
NodeName=c[1-200] NodeAddr=127.0.0.1 CPUs=128 RealMemory=1000000 Gres=gpu:8 State=CLOUD
PartitionName=gpu Nodes=c[1-200] Default=YES MaxTime=7-00:00:00 State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def big_controller(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SlurmCluster]:
    """A controller declaring 200 cloud nodes (8 GPUs each) in partition `gpu`; test-only use."""
    d = tmp_path_factory.mktemp("slurm-big")
    (d / "state").mkdir()
    conf = d / "slurm.conf"
    port = _free_port()
    conf.write_text(
        BIG_CONF.format(host=socket.gethostname().split(".")[0], port=port, port2=port + 1, dir=d)
    )
    (d / "gres.conf").write_text("NodeName=c[1-200] Name=gpu Count=8\n")
    big = SlurmCluster(conf=conf)
    big.run("slurmctld", "-f", str(conf), timeout=30)
    pid = 0
    try:
        for _ in range(60):
            if (d / "slurmctld.pid").exists() and (d / "slurmctld.pid").read_text().strip():
                pid = int((d / "slurmctld.pid").read_text())
            if pid and big.run("sinfo", "-h", check=False, timeout=10).returncode == 0:
                break
            time.sleep(0.25)
        else:
            pytest.fail(f"test-only controller did not answer\n{tail(d / 'slurmctld.log')}")
        yield big
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
                for _ in range(40):
                    os.kill(pid, 0)
                    time.sleep(0.25)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
