"""What the docs promise a user, checked against the code (issue 49, "Docs true").

Each test names the doc it keeps true: the README's `gyre sim` row, docs/tracking.md's
override example, docs/scheduler.md's `gyre plan` rule below E[d] = 0.5, and docs/runtime.md's
one progress line per step (the run's last step included), docs/architecture.md's map of
the runtime's rooms.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.cli import main
from gyre.errors import ConfigError
from gyre.runtime.coordinator.progress import Progress
from gyre.schedule.plan import plan_for
from gyre.sim.config import read_template

ROOT = Path(__file__).resolve().parents[1]


def test_gyre_sim_names_the_sim_templates_when_given_a_run_config(
    capsys: pytest.CaptureFixture,
) -> None:
    """README: `gyre sim templates/sim/...`; a run config is one clear error naming them."""
    for run_config in ("local.yaml", "cluster/nl2repo-32.yaml"):
        with pytest.raises(ConfigError, match=r"is a run config \(gyre run\); gyre sim takes a "
                           r"sim config such as templates/sim/nl2repo\.yaml"):  # fmt: skip
            read_template(ROOT / "templates" / run_config)
    assert main(["sim", str(ROOT / "templates" / "local.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "templates/sim/nl2repo.yaml" in err, err
    for template in sorted((ROOT / "templates" / "sim").rglob("*.yaml")):
        read_template(template)  # every sim template (and its `base:` chain) still loads


def test_the_tracking_docs_override_example_passes_a_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """docs/tracking.md's `gyre run templates/local.yaml ...` override line runs as written."""
    text = (ROOT / "docs" / "tracking.md").read_text()
    [line] = [x for x in text.splitlines() if x.startswith("gyre run templates/local.yaml ")]
    argv = shlex.split(line)[1:]
    argv[1] = str(ROOT / argv[1])
    run_dir = tmp_path / "would-be-run"
    assert main([*argv, "--dry-run", "--run-dir", str(run_dir)]) == 0, capsys.readouterr().err
    assert "checks passed" in capsys.readouterr().out and not run_dir.exists()


def test_plan_below_half_a_step_gives_elastic_the_target_not_the_minimum() -> None:
    """docs/scheduler.md: Elastic keeps φ ≥ 0.5 where E[d] allows it, else φ = E[d], μ = 1."""
    assert (plan_for("elastic", 1.5).phi, plan_for("elastic", 1.5).mu) == (0.5, 3)
    assert (plan_for("elastic", 0.3).phi, plan_for("elastic", 0.3).mu) == (0.3, 1)
    assert (plan_for("elastic", 1.2).phi, plan_for("elastic", 1.2).mu) == (pytest.approx(0.7), 2)


def _progress(steps: int) -> Progress:
    sched = SimpleNamespace(waterlevel=0, roles=[], version=0, published=0)
    cfg = SimpleNamespace(steps=steps)
    return Progress(cfg, sched, None, None, None)  # type: ignore[arg-type]


def _progress_steps(out: str) -> list[int]:
    prefix = "GYRE-PROGRESS "
    return [json.loads(x[len(prefix) :])["step"] for x in out.splitlines() if x.startswith(prefix)]


def test_every_step_gets_a_progress_line_the_last_one_included(
    capsys: pytest.CaptureFixture,
) -> None:
    """docs/runtime.md: one progress line per step. The coordinator's loop ends right after
    the last update's `line` call, so that call must print even within the rate limit."""
    progress = _progress(steps=3)
    for updates in (0, 0, 1, 1, 2, 3):  # back to back: well within 0.5 s of each other
        progress.line(updates)
    assert _progress_steps(capsys.readouterr().out) == [0, 1, 2, 3]  # repeats rate-limited


def test_the_architecture_page_names_every_module_of_each_runtime_room() -> None:
    """docs/architecture.md "The runtime's rooms": each room's row (the doors' too) names
    every module the room holds, so a module added, moved or renamed shows in the map."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines()
            if (line.startswith("| ") and "/` |" in line) or line.startswith("| doors |")}  # fmt: skip
    runtime = ROOT / "gyre" / "runtime"
    rooms = {"doors": runtime, **{f"{d.name}/": d for d in runtime.iterdir()
                                  if (d / "__init__.py").exists()}}  # fmt: skip
    assert set(rows) == set(rooms), f"rooms in the doc {sorted(rows)}, in the code {sorted(rooms)}"
    drawn = text[text.index("## The runtime's rooms") :]
    for name, folder in rooms.items():
        where = drawn if name == "shared/" else rows[name]  # shared's modules are in the drawing
        missing = [m.stem for m in folder.glob("*.py")
                   if m.stem != "__init__" and not re.search(rf"\b{m.stem}\b", where)]  # fmt: skip
        assert not missing, f"docs/architecture.md, room {name}: {missing} not named"
