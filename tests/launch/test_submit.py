"""The submitit side without a cluster: state parsing without accounting, the hetjob script."""

from __future__ import annotations

from pathlib import Path

from gyre.launch.spec import job_spec, load_launch
from gyre.launch.submit import HetSlurmExecutor, parse_scontrol

ROOT = Path(__file__).resolve().parents[2]

SCONTROL = """\
JobId=7 HetJobId=7 HetJobOffset=0 JobName=gyre JobState=RUNNING Reason=None NodeList=n1
JobId=8 HetJobId=7 HetJobOffset=1 JobName=gyre JobState=RUNNING Reason=None NodeList=n2
JobId=9 JobName=plain JobState=COMPLETED Reason=None NodeList=n3
"""


def test_parse_scontrol_reports_het_leaders_and_plain_jobs() -> None:
    info = parse_scontrol(SCONTROL)
    assert set(info) == {"7", "9"}
    assert info["7"]["State"] == "RUNNING" and info["9"]["State"] == "COMPLETED"


def test_executor_writes_the_hetjob_script_with_submitit_logs(tmp_path: Path) -> None:
    spec = job_spec(load_launch(ROOT / "templates" / "local.yaml"))
    ex = HetSlurmExecutor.__new__(HetSlurmExecutor)  # no srun needed to write the text
    ex.folder = tmp_path.resolve()
    ex.spec = spec
    text = ex._make_submission_file_text("python -u -m submitit.core._submit /x", "uid")
    assert text.count("#SBATCH hetjob") == 4
    assert "export SUBMITIT_EXECUTOR=slurm" in text
    assert f'--output {tmp_path.resolve()}/"${{SLURM_JOB_ID}}"_%t_log.out' in text
    assert "gyre-task \\\n  python -u -m submitit.core._submit /x &" in text
    assert ex._num_tasks() == 5
