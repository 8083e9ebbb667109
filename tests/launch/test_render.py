"""Rendered sbatch scripts are compared exactly with golden files, which the test only reads.

After an intended change to `gyre.launch` or a template, regenerate them on purpose (the
command prints which files changed), then review the diff:

    python tools/update_golden.py

The golden files include `slurm/gyre.sbatch`, the rendered embedded config. The test and the
command render through the same function (`update_golden.render`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.launch.render import RenderOptions, render_script
from gyre.launch.spec import job_spec, load_launch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
TEMPLATES = sorted(p.stem for p in (ROOT / "templates" / "cluster").glob("*.yaml"))


def _load_tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "update_golden", ROOT / "tools" / "update_golden.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


update_golden = _load_tool()


@pytest.mark.parametrize("golden", update_golden.GOLDEN, ids=lambda g: g.path.name)
def test_rendered_scripts_match_their_golden_files(golden) -> None:  # type: ignore[no-untyped-def]
    name = golden.path.relative_to(ROOT)
    assert golden.path.exists(), f"missing {name}; run python tools/update_golden.py"
    assert update_golden.render(golden) == golden.path.read_text(), (
        f"{name} differs from its rendering; after an intended change run "
        "python tools/update_golden.py and review the diff"
    )


def test_every_template_and_the_embedded_config_have_a_golden_file() -> None:
    paths = {g.path for g in update_golden.GOLDEN}
    assert paths == {GOLDEN / f"{n}.sbatch" for n in TEMPLATES} | {ROOT / "slurm" / "gyre.sbatch"}


def test_update_golden_rewrites_only_stale_files_and_names_them(tmp_path: Path) -> None:
    fresh, stale = (dataclasses.replace(g, path=tmp_path / g.path.name)
                    for g in update_golden.GOLDEN[:2])  # fmt: skip
    fresh.path.write_text(update_golden.render(fresh))
    stale.path.write_text("#!/bin/bash\n# an old rendering\n")
    assert update_golden.update([fresh, stale], write=False) == [stale.path]
    assert stale.path.read_text().endswith("an old rendering\n")  # --check writes nothing
    assert update_golden.update([fresh, stale]) == [stale.path]
    assert stale.path.read_text() == update_golden.render(stale)
    assert update_golden.update([fresh, stale]) == []


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


def _exports(tmp_path: Path, *overrides: str) -> list[str]:
    cfg = tmp_path / "run.yaml"
    cfg.write_text((ROOT / "templates" / "local.yaml").read_text())
    launch = load_launch(cfg, [f"runs_dir={tmp_path / 'runs'}", *overrides])
    text = render_script(job_spec(launch), RenderOptions(script="x.sbatch"))
    return [line for line in text.splitlines() if line.startswith("export MPIR_CVAR_CH4")]


def test_pmi2_jobs_use_a_netmod_whose_address_fits_slurms_pmi1_read(tmp_path: Path) -> None:
    """Under `--mpi=pmi2` the script selects MPICH's OFI netmod (a UCX address is cut by
    Slurm's 1024-byte PMI-1 read and MPI_Init fails); `slurm.env` chooses another netmod, and
    pmix jobs keep MPICH's default."""
    assert _exports(tmp_path) == ["export MPIR_CVAR_CH4_NETMOD=ofi"]
    assert _exports(tmp_path, "slurm.env.MPIR_CVAR_CH4_NETMOD=ucx") == [
        "export MPIR_CVAR_CH4_NETMOD=ucx"
    ]
    assert _exports(tmp_path, "slurm.mpi=pmix") == []


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


def test_render_o_makes_a_file_executable_and_leaves_anything_else_alone(tmp_path: Path) -> None:
    """`gyre render -o FILE` writes an executable script (read bits gain execute bits); an
    output that is not a regular file — a character device such as /dev/null, made here as
    a node of its own — is written to and keeps its mode (the CLI once chmodded it 0755)."""
    import os
    import stat

    script = tmp_path / "job.sbatch"
    device = tmp_path / "null"
    os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    device.chmod(0o666)  # mknod took the umask off
    for out in (script, device):
        done = subprocess.run(
            [sys.executable, "-m", "gyre", "render", "templates/cluster/swe-24.yaml", "-o", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    mode = stat.S_IMODE(script.stat().st_mode)
    assert mode & 0o111 == (mode & 0o444) >> 2 != 0
    assert script.read_text().startswith("#!")
    assert stat.S_IMODE(device.stat().st_mode) == 0o666
