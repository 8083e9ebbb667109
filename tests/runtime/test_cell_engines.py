"""Cells that serve from several engines (`engine.per_cell`): a `gyre run` whose 2 cells of
4 ranks each serve from two engines (engine j on the cell's rank j: e0, e1 for cell 0, e2, e3
for cell 1) and train as Megatron at TP 2 x DP 2 (the shared `replicas_run`, tests/worlds.py,
whose updates the invariance test replays). Every engine gets calls, every engine of a
cell is released on its switch to training, and each comes back serving the policy
published meanwhile."""

from __future__ import annotations

import json

import pytest
from worlds import INVARIANCE_STEPS, Ran

from gyre.trajectory.store import TraceReader


@pytest.mark.mpi
@pytest.mark.slow
def test_four_rank_cells_serve_from_two_engines_each(replicas_run: Ran) -> None:
    assert replicas_run.returncode == 0, replicas_run.output
    run_dir = replicas_run.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == INVARIANCE_STEPS
    assert summary["engines_per_cell"] == 2 and summary["train_backend"] == "megatron"
    assert (summary["parallel"]["tensor"], summary["parallel"]["data"]) == (2, 2)
    with TraceReader(run_dir / "trace.h5") as r:
        events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
        execs = [i.execution_id for i in r.executions() if i.status != "not_launched"]
        served = {n.engine_id for eid in execs for n in r.tree(eid).nodes}
    assert served == {"e0", "e1", "e2", "e3"}, served  # the proxy balanced over all four

    published, trains, returns = 0, [], []
    for kind, detail in events:
        if kind == "publish":
            published = detail["version"]
        elif kind == "switch" and detail["to"] == "train":
            trains.append((detail["cell"], detail["engines"], detail["engines_released"]))
        elif kind == "switch" and detail["to"] == "rollout":
            returns.append((detail["cell"], detail["engines"], detail["engine_versions"],
                            published))  # fmt: skip
    engines = {0: [0, 1], 1: [2, 3]}
    assert {c for c, _, _ in trains} == {0, 1}, trains  # colocate: every cell trained
    assert all(e == engines[c] and released == [True, True] for c, e, released in trains)
    assert {c for c, _, _, p in returns if p > 0} == {0, 1}, returns
    for cell, e, versions, p in returns:  # both engines serve the published policy
        assert e == engines[cell] and versions == [p, p], returns
