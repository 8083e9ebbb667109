"""Gyre's job across Slurm nodes that do not share a loopback (tools/slurm_local.sh start-netns).

Every node of this local cluster lives in its own network namespace (own loopback, one
address on a private bridge, 10.213.1.0/24, made and removed by the fixture), as on a real
cluster: an engine bound to 127.0.0.1, or a rank that takes "same host name" for "same
machine", cannot be reached from another node. `gyre submit templates/cluster-cpu.yaml`
runs 2-rank cells across six such nodes for two steps; the test checks that the job
completes with a closed trace, that every cell's engine listened on its own node's bridge
address, and that it was reached there: the proxy's model calls (every step trains on
executions; the proxy's node hosts no engine) and the core's publication (no engine missed).
With the engines bound to 127.0.0.1 the same job still "completes", with harness errors, an
empty step and engines missed by the publication: these assertions are what fail.

The cluster uses its own state folder, ports (6927/6928), namespaces (gyret-n1..6) and bridge
(gyret-br), so the plain local cluster of tests/launch/test_slurm.py can run beside it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launch.conftest import ROOT, SlurmCluster
from launch.test_slurm import assert_valid_trace, gyre

pytestmark = pytest.mark.slurm
NODES, CPUS, STEPS = 6, 2, 2
NET = "10.213.1"  # this test's own /24: nothing is sent anywhere else
SETTINGS = {"GYRE_NETNS_PREFIX": "gyret", "GYRE_NETNS_NET": NET, "GYRE_SLURM_PORT": "6927"}


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Six namespaced nodes; the daemons, namespaces, veths and bridge go at teardown."""
    state = tmp_path_factory.mktemp("slurm-netns")
    env = dict(os.environ, GYRE_SLURM_DIR=str(state), **SETTINGS)
    script = str(ROOT / "tools" / "slurm_local.sh")

    def local(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["timeout", "-s", "KILL", "240", "bash", script, *args], env=env,
                              capture_output=True, text=True)  # fmt: skip

    try:
        start = local("start-netns", str(NODES), str(CPUS))
        if start.returncode:
            pytest.fail(f"namespaced local Slurm did not start (root and iproute2 needed):\n"
                        f"{start.stderr[-3000:]}")  # fmt: skip
        yield SlurmCluster(conf=state / "slurm.conf")
    finally:
        local("stop-netns")


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The coordinator's `events` rows of the run's trace."""
    from gyre.trajectory.reader import TraceReader

    with TraceReader(run_dir / "trace.h5") as reader:
        return reader.rows("events")


def listening(log: Path) -> str:
    """The address in the engine's ``gyre engine listening on http://HOST:PORT`` line."""
    found = re.findall(r"listening on http://([^:/]+):\d+", log.read_text(errors="replace"))
    assert found, f"no listening line in {log}"
    return str(found[-1])


@pytest.mark.slow
def test_two_rank_cells_across_namespaced_nodes(netns_cluster: SlurmCluster, tmp_path: Path):
    """Each cell's two ranks on two namespaced nodes, as Megatron tensor-parallel halves of
    every layer (train.backend megatron; its gloo world bound to the nodes' bridge
    addresses): the engines, the control channel, the snapshot transport and the backend's
    own world all cross nodes. (The torch backend's 2-rank cells run the same job across
    nodes that share a loopback in tests/launch/test_slurm.py.)"""
    backend = "megatron"
    folder = tmp_path / "sub"
    try:
        out = gyre(
            netns_cluster, tmp_path, "submit", str(ROOT / "templates" / "cluster-cpu.yaml"),
            "--steps", str(STEPS), "--folder", str(folder), "--timeout", "300",
            "timeouts.startup_s=120", "timeouts.stall_s=120", f"train.backend={backend}",
            timeout=360,
        )  # fmt: skip
    finally:  # a job the client gave up on must not keep cores busy
        netns_cluster.run("scancel", "--user", "root", check=False)
    if out.returncode:
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in folder.glob("*_log.*"))
        pytest.fail(out.stdout + out.stderr[-3000:] + logs)
    run_dir = Path(json.loads(out.stdout[out.stdout.index("{") :])["run_dir"])
    assert_valid_trace(run_dir, STEPS)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["empty_steps"] == 0 and all(s["executions"] > 0 for s in summary["steps"])
    assert summary["train_backend"] == backend
    published = [json.loads(e["detail"]) for e in events(run_dir) if e["kind"] == "publish"]
    assert published and all(not p["missed"] for p in published), published
    cells = summary["cell_hosts"]
    assert len(cells) == 2 and len({n for nodes in cells for n in nodes}) == 4, cells
    for c, nodes in enumerate(cells):  # the cell's leader (shard 0) hosts its engine
        host = listening(run_dir / "logs" / f"engine-cell{c}.log")
        assert not ipaddress.ip_address(host).is_loopback, host
        assert host == f"{NET}.{nodes[0].removeprefix('n')}", (host, nodes)
