"""`gyre trace show`: run listing and one execution's tree, human and --json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from trajectory_strategies import make_tree

from gyre.errors import StoreError
from gyre.trajectory import cli
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import TrajectoryTree


def run(argv: list[str]) -> int:
    """Parse and dispatch exactly as `gyre.cli.main` does for the trace subcommand."""
    parser = argparse.ArgumentParser(prog="gyre")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, TrajectoryTree]:
    path = tmp_path / "trace.h5"
    done = make_tree(7, "g0-e0", 6)
    with TraceWriter(path, run_meta={"config": "model: tiny\n"}) as w:
        w.open_execution("g0-e0", {"task": "fix-bug"})
        w.close_execution("g0-e0", done, status="completed")
        w.open_execution("g0-[e1]")
        w.record_node("g0-[e1]", make_tree(8, "g0-[e1]", 2).nodes[0])
        w.append("steps", [{"step": 0, "t": 0.0, "name": "loss", "value": 1.5}])
    return path, done


def test_json_listing(trace: tuple[Path, TrajectoryTree], capsys: pytest.CaptureFixture) -> None:
    path, done = trace
    assert run(["trace", "show", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == "1.3" and doc["writer_closed"] is True
    assert doc["run_meta"] == {"config": "model: tiny\n"}
    assert doc["tables"]["steps"] == 1
    e0, e1 = doc["executions"]
    assert (e0["execution_id"], e0["status"], e0["num_nodes"]) == ("g0-e0", "completed", 6)
    assert e0["flat_tokens"] == done.stats().flat_tokens and e0["meta"] == {"task": "fix-bug"}
    assert (e1["execution_id"], e1["status"], e1["num_nodes"]) == ("g0-[e1]", "open", 1)


def test_json_tree_round_trips(
    trace: tuple[Path, TrajectoryTree], capsys: pytest.CaptureFixture
) -> None:
    path, done = trace
    assert run(["trace", "show", str(path), "--execution", "g0-e0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert TrajectoryTree.from_dict(doc["tree"]) == done
    assert doc["leaves"] == done.leaves() and doc["stats"]["num_nodes"] == 6


def test_human_output(trace: tuple[Path, TrajectoryTree], capsys: pytest.CaptureFixture) -> None:
    path, done = trace
    assert run(["trace", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "g0-e0" in out and "completed" in out and "g0-[e1]" in out and "open" in out
    assert run(["trace", "show", str(path), "--execution", "g0-[e1]"]) == 0
    out = capsys.readouterr().out
    assert "status open" in out and "nodes 1" in out
    assert run(["trace", "show", str(path), "--execution", "g0-e0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if ln.startswith("│")]
    assert len(rows) == len(done)
    for row, node in zip(rows, done.nodes):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[:2] == [str(node.node_id), str(node.parent_id)]


def test_unknown_execution_is_an_error(trace: tuple[Path, TrajectoryTree]) -> None:
    with pytest.raises(StoreError, match="no execution 'nope'"):
        run(["trace", "show", str(trace[0]), "--execution", "nope"])
