"""Gyre's heterogeneous job under a real local Slurm (tools/slurm_local.sh, six nodes).

* `sbatch slurm/gyre.sbatch` and `gyre submit` run the embedded config's world (coordinator,
  proxy, three cells on five nodes); first with the probe entry (every rank's component from
  SLURM_PROCID / SLURM_NTASKS_HET_GROUP_<n>, an allreduce), then the real runtime, which
  must leave a closed trace;
* `gyre submit templates/cluster-cpu.yaml` runs 2-rank cells, each spread over two nodes;
* SIGUSR1 mid-run checkpoints, requeues (same job id, SLURM_RESTART_COUNT=1) and resumes with
  no step lost or repeated;
* `sbatch --test-only` accepts the paper-sized templates on a 200-node controller;
* configs the cluster cannot run are rejected before submission.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch.conftest import ROOT, SlurmCluster, tail

pytestmark = pytest.mark.slurm
SCRIPT = str(ROOT / "slurm" / "gyre.sbatch")
LOCAL = str(ROOT / "templates" / "local.yaml")


def sbatch(cluster: SlurmCluster, cwd: Path, *args: str, **env: str) -> str:
    out = cluster.run("sbatch", "--parsable", *args, cwd=cwd, env=cluster.env(**env), timeout=60)
    return out.stdout.strip().split(";")[0]


def gyre(cluster: SlurmCluster, cwd: Path, *args: str, timeout: float = 240, **env: str):
    return cluster.run(
        sys.executable, "-m", "gyre", *args, cwd=cwd, env=cluster.env(**env), timeout=timeout,
        check=False,
    )  # fmt: skip


def test_sbatch_probe_world_spans_the_het_components(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job = sbatch(
        slurm_cluster, tmp_path, SCRIPT, LOCAL,
        GYRE_ENTRY="gyre.launch.probe", GYRE_RUN_DIR=str(run_dir), GYRE_STEPS="2",
    )  # fmt: skip
    log = tmp_path / f"gyre-{job}.out"
    assert slurm_cluster.wait_state(job, ("COMPLETED",), 90, log) == "COMPLETED", tail(log)
    probe = json.loads((run_dir / "probe.json").read_text())
    assert probe["ok"] and probe["world_size"] == 5 and probe["allreduce"] == 10
    ranks = probe["ranks"]
    assert [r["slurm"] for r in ranks] == [
        ["coordinator", 0, 0],
        ["proxy", 0, 0],
        ["cell", 0, 0],
        ["cell", 1, 0],
        ["cell", 2, 0],
    ]
    assert [r["het_group"] for r in ranks] == [0, 1, 2, 3, 4]
    assert len({r["host"] for r in ranks}) == 5  # one node per component
    assert "allocation matches" in log.read_text()


def test_sbatch_with_a_config_of_another_topology_stops_early(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    other = tmp_path / "two-cells.yaml"
    data = yaml.safe_load(Path(LOCAL).read_text())
    data["topology"]["cells"] = 2
    other.write_text(yaml.safe_dump(data))
    job = sbatch(slurm_cluster, tmp_path, SCRIPT, str(other), GYRE_RUN_DIR=str(tmp_path / "r"))
    log = tmp_path / f"gyre-{job}.out"
    assert slurm_cluster.wait_state(job, ("FAILED",), 60, log) == "FAILED"
    text = log.read_text()
    assert "tasks per het component [1, 1, 1, 1, 1]" in text and "needs [1, 1, 1, 1]" in text
    assert f"gyre render {other} -o job.sbatch" in text


def test_sigusr1_checkpoints_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    steps = 12
    job = sbatch(
        slurm_cluster, tmp_path, SCRIPT, LOCAL,
        GYRE_ENTRY="gyre.launch.probe", GYRE_RUN_DIR=str(run_dir), GYRE_STEPS=str(steps),
        GYRE_PROBE_STEP_SECONDS="0.5",
    )  # fmt: skip
    log = tmp_path / f"gyre-{job}.out"
    step_log = run_dir / "probe-steps.jsonl"
    deadline = time.monotonic() + 60
    while not (step_log.exists() and len(step_log.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.3)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    # requeued jobs wait AuthInfo cred_expire (10 s in slurm_local.sh) before starting again
    assert slurm_cluster.wait_state(job, ("COMPLETED",), 120, log) == "COMPLETED", tail(log)
    rows = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # none lost, none repeated
    restarts = [r["restart"] for r in rows]
    assert restarts[0] == 0 and restarts[-1] == 1 and restarts == sorted(restarts)
    text = log.read_text()
    assert "SIGUSR1: asking the coordinator to checkpoint" in text
    assert f"requeueing job {job}" in text and "restart 1" in text
    assert re.search(r"resuming after step \d+", text)
    out = slurm_cluster.run("scontrol", "show", "job", job).stdout
    assert "Restarts=1" in out


def test_gyre_submit_probe_keeps_submitit_handle(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = gyre(
        slurm_cluster, tmp_path, "submit", LOCAL, "--entry", "gyre.launch.probe",
        "--steps", "2", "--folder", str(tmp_path / "sub"), "--timeout", "120",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"submitted job (\d+)", out.stdout)
    assert ": COMPLETED" in out.stdout
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["rank"] == 0 and result["restart_count"] == 0
    probe = json.loads((Path(result["run_dir"]) / "probe.json").read_text())
    assert probe["ok"] and len({r["host"] for r in probe["ranks"]}) == 5


def test_submit_rejects_what_the_cluster_cannot_run(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    base = yaml.safe_load(Path(LOCAL).read_text())
    cases = {
        "missing-partition": (
            {"slurm": {"partition": "h100"}},
            "asks for 'h100', which this cluster does not have; allowed partitions: gyre",
        ),
        "too-many-nodes": (
            {"topology": {"cells": 6}},
            "asks for 8 nodes in partition 'gyre'",
        ),
        "layout": (
            {"topology": {"ranks_per_cell": 3}, "slurm": {"nodes_per_cell": 2}},
            "slurm.nodes_per_cell: 2 does not divide topology.ranks_per_cell (3)",
        ),
    }
    for name, (change, needle) in cases.items():
        data = json.loads(json.dumps(base))
        for section, values in change.items():
            data.setdefault(section, {}).update(values)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        out = gyre(slurm_cluster, tmp_path, "submit", str(path), "--no-follow", timeout=120)
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert needle in out.stderr, (name, out.stderr)
    queue = slurm_cluster.run("squeue", "--noheader").stdout
    assert queue.strip() == ""  # nothing was submitted


def test_test_only_accepts_the_cluster_templates(
    big_controller: SlurmCluster, tmp_path: Path
) -> None:
    for name in ("nl2repo-32", "swe-24", "nl2repo-192"):
        template = str(ROOT / "templates" / "cluster" / f"{name}.yaml")
        script = tmp_path / f"{name}.sbatch"
        # the template names a suite on the cluster's shared file system, absent here
        out = gyre(big_controller, tmp_path, "render", template, "--check", timeout=120)
        assert out.returncode == 2 and "harness.suite: task suite '/shared/suites/" in out.stderr
        out = gyre(
            big_controller, tmp_path, "render", template, "harness.suite=builtin", "--check",
            "-o", str(script), timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        test = big_controller.run("sbatch", "--test-only", str(script), cwd=tmp_path)
        assert re.search(r"Job \d+ to start at", test.stderr), test.stderr
    too_big = tmp_path / "too-big.yaml"
    data = yaml.safe_load((ROOT / "templates/cluster/swe-24.yaml").read_text())
    data["topology"]["cells"] = 50
    too_big.write_text(yaml.safe_dump(data))
    out = gyre(big_controller, tmp_path, "render", str(too_big), "harness.suite=builtin", "--check",
               timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "asks for 202 nodes in partition 'gpu'" in out.stderr and "which has 200" in out.stderr


def trace_docs(run_dir: Path) -> list[dict]:
    """`gyre trace show --json` of every trace segment (trace.h5, trace.1.h5, ...)."""
    docs = []
    for path in sorted(run_dir.glob("trace*.h5")):
        out = subprocess.run(
            [sys.executable, "-m", "gyre", "trace", "show", str(path), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        docs.append(json.loads(out.stdout))
    assert docs, f"no trace in {run_dir}"
    return docs


def assert_valid_trace(run_dir: Path, steps: int) -> list[str]:
    """Every segment closed, every execution closed and recorded once; all steps done."""
    docs = trace_docs(run_dir)
    assert all(d["writer_closed"] for d in docs)
    executions = [e for d in docs for e in d["executions"]]
    assert executions and all(e["closed"] for e in executions)
    ids = [e["execution_id"] for e in executions]
    assert len(ids) == len(set(ids)), "an execution was recorded twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == steps
    return ids


@pytest.mark.slow
def test_runtime_through_sbatch_checkpoints_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir, steps = tmp_path / "run", 2
    job = sbatch(
        slurm_cluster, tmp_path, SCRIPT, LOCAL, GYRE_RUN_DIR=str(run_dir), GYRE_STEPS=str(steps)
    )
    log = tmp_path / f"gyre-{job}.out"
    deadline = time.monotonic() + 420
    while '"step": 1' not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, tail(log)
        assert slurm_cluster.job_state(job) in ("PENDING", "RUNNING"), tail(log)
        time.sleep(1.0)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    assert slurm_cluster.wait_state(job, ("COMPLETED",), 600, log) == "COMPLETED", tail(log)
    text = log.read_text()
    assert f"requeueing job {job}" in text and "restart 1" in text, tail(log)
    saved = sorted(run_dir.glob("checkpoints/v*/state.json"))
    assert saved, "the USR1 checkpoint was not committed"
    resumed = json.loads((run_dir / "summary.json").read_text())["resumed_from"]
    assert resumed is not None and 1 <= resumed["updates"] < steps  # preempted mid-run
    states = [json.loads(path.read_text()) for path in saved]
    assert resumed["updates"] in [s["updates"] for s in states]  # the USR1 one, resumed from
    assert states[-1]["updates"] == steps  # the finished run ends with its last update's
    assert [p.name for p in run_dir.glob("trace*.h5")] == ["trace.h5"]  # one trace, continued
    assert_valid_trace(run_dir, steps)


@pytest.mark.slow
def test_multi_rank_cells_across_nodes_through_gyre_submit(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """templates/cluster-cpu.yaml as an operator submits it: 2 cells of 2 ranks, each cell on
    2 Slurm nodes, so every gradient sum and snapshot pull crosses a node boundary."""
    folder = tmp_path / "sub"
    try:
        out = gyre(
            slurm_cluster, tmp_path, "submit", str(ROOT / "templates" / "cluster-cpu.yaml"),
            "--steps", "1", "--folder", str(folder), "--timeout", "420", timeout=480,
        )  # fmt: skip
    finally:  # a job the client gave up on must not keep cores busy for the rest of the suite
        slurm_cluster.run("scancel", "--user", "root", check=False)
    if out.returncode:
        logs = "".join(p.read_text(errors="replace")[-1500:] for p in folder.glob("*_log.err"))
        pytest.fail(out.stdout + out.stderr[-3000:] + logs)
    result = json.loads(out.stdout[out.stdout.index("{") :])
    run_dir = Path(result["run_dir"])
    assert_valid_trace(run_dir, 1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks_per_cell"] == 2
    cells = summary["cell_hosts"]  # the Slurm node of every rank of every cell
    assert len(cells) == 2 and all(len(set(nodes)) == 2 for nodes in cells), cells
    assert len({n for nodes in cells for n in nodes}) == 4, cells
