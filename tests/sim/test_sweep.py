"""What-if sweeps: budget-keeping keys, the grid, the best point, the CLI table/plot/JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.cli import main
from gyre.config import load
from gyre.errors import ConfigError
from gyre.sim.cli import PLANNING_KEYS
from gyre.sim.config import SimConfig, read_template
from gyre.sim.simulator import Simulator
from gyre.sim.sweep import apply_point, parse_sweeps, run_sweep

from .paths import TEMPLATE


def test_planning_keys_keep_the_node_budget() -> None:
    data = read_template(TEMPLATE)  # 32 nodes = 8 cells x 4, 144 per cell
    four = apply_point(data, "cells", 4, ["elastic"])["scheduler"]
    assert (four["nodes"], four["cells"], four["concurrency_per_cell"]) == (32, 4, 288)
    big = apply_point(data, "nodes_per_cell", 8, ["elastic"])["scheduler"]
    assert big["cells"] == 4 and big["concurrency_per_cell"] == 288
    pool = apply_point(data, "standalone_nodes", 8, ["elastic"])["scheduler"]
    assert (pool["nodes"], pool["cells"], pool["standalone_nodes"]) == (24, 6, 8)
    both = apply_point(data, "phi_mu", "1.5/1", ["elastic", "async"])["policies"]
    assert both["elastic"]["phi"] == 1.5 and both["async"]["mu"] == 1
    deep = apply_point(data, "workload.harness_timeout_h", 3.0, ["elastic"])
    assert deep["workload"]["harness_timeout_h"] == 3.0
    assert data["scheduler"]["cells"] == 8  # the template itself is unchanged
    with pytest.raises(ConfigError, match="does not divide"):
        apply_point(data, "nodes_per_cell", 5, ["elastic"])


@pytest.mark.parametrize("key", PLANNING_KEYS)
def test_every_planning_key_gives_a_valid_template(key: str) -> None:
    """Each key the help and docs list (`gyre sim --sweep KEY=...`) sets a loadable point."""
    value = {"cells": 4, "nodes_per_cell": 8, "standalone_nodes": 8, "concurrency_per_cell": 96,
             "phi": 1.0, "mu": 2, "phi_mu": "1.0/2", "staleness": 1.5}[key]  # fmt: skip
    point = apply_point(read_template(TEMPLATE), key, value, ["elastic"])
    load(SimConfig, point, path="sim")
    if key == "concurrency_per_cell":
        assert point["scheduler"]["concurrency_per_cell"] == 96


def test_sweep_text_is_checked() -> None:
    assert parse_sweeps(["cells=4,8", "phi_mu=0.5/3"]) == [("cells", [4, 8]),
                                                          ("phi_mu", ["0.5/3"])]  # fmt: skip
    for bad in ("cells", "=4", "cells="):
        with pytest.raises(ConfigError, match="KEY=V1,V2"):
            parse_sweeps([bad])


def _small() -> dict:
    data = read_template(TEMPLATE)
    data["scheduler"].update(nodes=8, cells=4, train_layout_nodes=2, concurrency_per_cell=8,
                             group_size=4, batch_groups=4, join_min_microsteps=2)  # fmt: skip
    data["policies"]["async"]["train_cells"] = 1
    return data


def test_grid_marks_the_fastest_point_of_each_policy_and_reports_invalid_ones() -> None:
    def simulate(runs: list) -> list:
        return [Simulator(cfg, p, steps=3).run() for cfg, p in runs]

    sweeps = parse_sweeps(["cells=2,4", "standalone_nodes=0,2"])
    points = run_sweep(_small(), sweeps, ["elastic", "async"], simulate)
    assert len(points) == 8
    # 2 cells of 4 nodes cannot have a 2-node standalone pool: reported, not run
    bad = [pt for pt in points if pt.values == {"cells": 2, "standalone_nodes": 2}]
    assert bad and all(pt.result is None and "does not divide" in pt.error for pt in bad)
    for policy in ("elastic", "async"):
        run = [pt for pt in points if pt.policy == policy and pt.result is not None]
        best = [pt for pt in run if pt.best]
        assert len(best) == 1
        assert best[0].result.total_h == min(pt.result.total_h for pt in run)  # type: ignore[union-attr]


def test_sweep_cli_prints_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "small.yaml"
    cfg.write_text(
        f"base: {TEMPLATE}\nscheduler: {{nodes: 8, cells: 4, train_layout_nodes: 2, "
        "concurrency_per_cell: 8, group_size: 4, batch_groups: 4}\n"
        "policies: {async: {train_cells: 1}}\n"
    )
    png = tmp_path / "sweep.png"
    argv = ["sim", str(cfg), "--steps", "2", "--sweep", "phi_mu=0.5/1,1/1", "--plot", str(png)]
    assert main([*argv, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "phi_mu" in out and out.count("*") == 3  # one best per policy
    assert png.stat().st_size > 1000
    assert main([*argv, "--policy", "elastic", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["points"]) == 2 and data["best"]["elastic"]["best"] is True
    assert main(["sim", str(cfg), "--sweep", "cells"]) == 2
    assert "KEY=V1,V2" in capsys.readouterr().err
