"""Rendered sbatch scripts are compared exactly with golden files.

Regenerate after an intended change (then review the diff):

    GYRE_UPDATE_GOLDEN=1 python -m pytest tests/launch/test_render.py
    # slurm/gyre.sbatch is the rendered embedded config:
    gyre render templates/local.yaml -o slurm/gyre.sbatch
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.launch.render import RenderOptions, render_script
from gyre.launch.spec import job_spec, load_launch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
TEMPLATES = ["nl2repo-32", "swe-24", "nl2repo-192"]


def rendered(config: str, script: str) -> str:
    # paths as a user types them from the repository root, so the text is machine independent
    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        return render_script(job_spec(load_launch(config)), RenderOptions(script=script))
    finally:
        os.chdir(cwd)


def check_golden(text: str, golden: Path) -> None:
    if os.environ.get("GYRE_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with GYRE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden.name} differs; see the module docstring"


@pytest.mark.parametrize("name", TEMPLATES)
def test_cluster_template_scripts_match_golden(name: str) -> None:
    text = rendered(f"templates/cluster/{name}.yaml", f"{name}.sbatch")
    check_golden(text, GOLDEN / f"{name}.sbatch")


def test_slurm_gyre_sbatch_is_the_rendered_embedded_config() -> None:
    text = rendered("templates/local.yaml", "slurm/gyre.sbatch")
    check_golden(text, ROOT / "slurm" / "gyre.sbatch")


@pytest.mark.parametrize("name", TEMPLATES)
def test_scripts_are_valid_bash(name: str) -> None:
    subprocess.run(["bash", "-n", str(GOLDEN / f"{name}.sbatch")], check=True)


def test_script_shape_for_the_32_node_template() -> None:
    text = (GOLDEN / "nl2repo-32.sbatch").read_text()
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header.count("#SBATCH hetjob") == 9  # 10 components
    assert "#SBATCH --signal=B:USR1@600" in header and "#SBATCH --requeue" in header
    assert header.count("#SBATCH --nodes=4") == 8 and header.count("#SBATCH --gpus-per-node=8") == 8
    assert "srun --het-group=0-9 --mpi=pmi2" in text
    assert 'source "${GYRE_VENV:-$HOME/gyre-venv}/bin/activate"' in text


def test_cli_render_prints_and_writes(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "render", "templates/cluster/swe-24.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.replace("gyre.sbatch", "swe-24.sbatch") == (GOLDEN / "swe-24.sbatch").read_text()
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("topology: {cells: 2}\nslurm: {mpi: openmpi}\n")
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "render", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "run.slurm.mpi: 'openmpi' is not allowed; choose one of 'pmi2', 'pmix'" in out.stderr
