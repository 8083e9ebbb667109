"""`gyre submit`: Gyre's heterogeneous job through submitit, with submitit's job handle.

submitit (1.5) submits homogeneous jobs only. `HetSlurmExecutor` keeps everything else of
`submitit.SlurmExecutor` (pickling the call, sbatch, the `Job` handle with id, state,
stdout / stderr, cancel and result) and replaces only the script it writes: the same
rendered hetjob script as `gyre render`, whose one `srun --het-group=0-N` step runs
submitit's task entry in every rank. Each rank then calls `run_task`, which runs the
runtime's per-rank main in-process; `job.result()` is rank 0's (the coordinator's) summary.

Without Slurm accounting `sacct` fails and plain submitit reports state UNKNOWN forever;
`GyreJob` asks `scontrol` in that case, so `job.state` and `job.done()` stay truthful.

    job = submit(load_launch("templates/local.yaml"), folder="runs/submitit")
    job.job_id, job.state, job.result(), job.stdout(), job.cancel()
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import submitit
from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

from gyre.errors import GyreError
from gyre.launch.render import ENTRY, RenderOptions, render_script
from gyre.launch.spec import JobSpec, Launch, job_spec
from gyre.launch.task import EXIT_CHECKPOINTED

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


class LaunchError(GyreError):
    """A job could not be submitted, or a rank of it failed."""


class GyreInfoWatcher(submitit_slurm.SlurmInfoWatcher):
    """submitit's state watcher, falling back to `scontrol` when accounting is off."""

    _sacct_ok: bool | None = None

    def _make_command(self) -> list[str] | None:
        command = super()._make_command()
        if command is None or self._accounting():
            return command
        return ["scontrol", "show", "job", "--oneliner"]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        if "JobState=" not in text:
            return super().read_info(text)
        return parse_scontrol(text)

    @classmethod
    def _accounting(cls) -> bool:
        if cls._sacct_ok is None:
            probe = subprocess.run(
                ["sacct", "--noheader", "--parsable2", "--jobs", "1"],
                capture_output=True,
                timeout=30,
            )
            cls._sacct_ok = probe.returncode == 0
        return cls._sacct_ok


def parse_scontrol(text: str) -> dict[str, dict[str, str]]:
    """{job id: {"JobID", "State", "NodeList"}} from `scontrol show job --oneliner` text.

    A heterogeneous job is reported by its leader (het offset 0), as sbatch printed it.
    """
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" not in fields or fields.get("HetJobOffset", "0") != "0":
            continue
        out[fields["JobId"]] = {
            "JobID": fields["JobId"],
            "State": fields.get("JobState", "UNKNOWN"),
            "NodeList": fields.get("NodeList", ""),
        }
    return out


class GyreJob(submitit_slurm.SlurmJob[Any]):
    """submitit's Slurm job handle with a watcher that works without accounting."""

    watcher = GyreInfoWatcher(delay_s=30)

    def result(self) -> Any:
        """The coordinator's (rank 0's) result; raises if any rank failed."""
        return self.results()[0]


class HetSlurmExecutor(submitit.SlurmExecutor):
    """A submitit executor whose every submission is Gyre's heterogeneous job for `spec`."""

    job_class = GyreJob

    def __init__(self, folder: str | Path, spec: JobSpec, python: str | None = None) -> None:
        folder = Path(folder)
        if "%j" in str(folder):
            raise LaunchError(f"submitit folder {folder}: must not contain %j (hetjob logs)")
        super().__init__(folder, max_num_timeout=0, python=python)
        self.spec = spec

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        # submitit reads task t's logs at <folder>/<job id>_<t>_log.{out,err}; inside a het
        # step srun's %j is each component's own id, so the leader's id is spelled out.
        logs = shlex.quote(str(self.folder.resolve())) + '/"${SLURM_JOB_ID}"_%t_log'
        options = RenderOptions(
            config=str(self.spec.launch.path.resolve()),
            script=str(self.folder.resolve() / "<job id>_submission.sh"),
            output=str(self.folder.resolve() / "%j_batch.out"),
            command=command,
            srun_args=["--output", f"{logs}.out", "--error", f"{logs}.err"],
            exports={"SUBMITIT_EXECUTOR": "slurm"},
        )
        return render_script(self.spec, options)

    def _num_tasks(self) -> int:
        return self.spec.world_size


def run_task(entry: str = ENTRY, steps: int | None = None) -> dict[str, Any]:
    """Body of every rank under submitit: run `entry`'s main for this rank.

    The config and run directory come from the batch script's environment (`GYRE_CONFIG`,
    `GYRE_RUN_DIR`), so a requeued job resumes in the same run directory. After a
    checkpoint-and-exit the process exits with `EXIT_CHECKPOINTED` (no result is written;
    the requeued job runs this call again).
    """
    config, run_dir = os.environ["GYRE_CONFIG"], os.environ["GYRE_RUN_DIR"]
    argv = [config, "--run-dir", run_dir]
    if steps is not None:
        argv += ["--steps", str(steps)]
    status = int(importlib.import_module(entry).main(argv) or 0)
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    if status == EXIT_CHECKPOINTED:
        sys.exit(status)
    if status:
        raise LaunchError(f"rank {rank}: {entry} exited with status {status}")
    return {
        "rank": rank,
        "run_dir": str(Path(run_dir).resolve()),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def submit(
    launch: Launch,
    folder: str | Path,
    entry: str = ENTRY,
    steps: int | None = None,
    python: str | None = None,
) -> GyreJob:
    """Submit the run's heterogeneous job through submitit; returns submitit's job handle."""
    spec = job_spec(launch)
    executor = HetSlurmExecutor(folder, spec, python=python)
    try:
        job = executor.submit(run_task, entry, steps)
    except submitit_utils.FailedSubmissionError as e:
        raise LaunchError(f"sbatch refused the job: {e}") from None
    assert isinstance(job, GyreJob)
    return job


def follow(job: GyreJob, timeout_s: float | None = None, poll_s: float = 1.0) -> Any:
    """Wait for `job`, printing state changes; rank 0's result, or `LaunchError` with logs."""
    start = time.monotonic()
    state, delay = "", poll_s
    while True:
        job.watcher.update()
        now = job.state
        if now != state:
            print(f"[gyre] job {job.job_id}: {now}", flush=True)
            state, delay = now, poll_s
        if job.done() or now in FINAL_STATES:
            break
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise LaunchError(f"job {job.job_id} still {now} after {timeout_s:.0f}s")
        time.sleep(delay)
        delay = min(delay * 1.5, 10.0)
    _final_state(job, state, poll_s)
    try:
        return job.result()
    except submitit_utils.UncompletedJobError as e:
        raise LaunchError(f"job {job.job_id} ended {job.state} without a result:\n{e}") from None
    except submitit_utils.FailedJobError as e:
        raise LaunchError(f"job {job.job_id} failed:\n{e}") from None


def _final_state(job: GyreJob, state: str, poll_s: float, wait_s: float = 30.0) -> None:
    """Results can land before Slurm marks the job done: wait (bounded) for its end state."""
    deadline = time.monotonic() + wait_s
    while state not in FINAL_STATES and time.monotonic() < deadline:
        time.sleep(poll_s)
        job.watcher.update()
        if job.state != state:
            state = job.state
            print(f"[gyre] job {job.job_id}: {state}", flush=True)
