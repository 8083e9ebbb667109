"""Trace replay: a recorded run's workload and costs are fitted, replayed and compared."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from gyre.cli import main
from gyre.errors import StoreError
from gyre.sim.replay import fit, read_run
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import TrajectoryTree

T0 = 1_000_000.0
CONFIG = {
    "name": "synthetic",
    "topology": {"cells": 2, "ranks_per_cell": 1, "standalone_engines": 0},
    "schedule": {"policy": "elastic", "streaming": None, "train_cells": 1,
                 "concurrency_per_cell": 2, "group_size": 2, "batch_groups": 1, "phi": 0.0,
                 "mu": 1, "supply_fraction": 1.0, "join_min_microsteps": 1},
    "harness": {"harness_timeout_s": 50.0, "overall_timeout_s": 60.0},
    "train": {"j_max": 5},
}  # fmt: skip


def _tree(eid: str, start: float, calls: list[tuple[float, float, int]]) -> TrajectoryTree:
    tree = TrajectoryTree(eid)
    for i, (t0, t1, n) in enumerate(calls):
        tree.add_node(
            parent_id=i, input_ids=np.arange(n, dtype=np.int32) % 50,
            input_provenance=np.full(n, 2, np.uint8), output_ids=np.array([7, 8], np.int32),
            output_logprobs=np.array([-0.5, -0.5], np.float32), role="main", policy_version=0,
            engine_id="e0", t_start=start + t0, t_end=start + t1, finish_reason="stop",
            input_key=bytes([i]), output_key=bytes([i + 100]),
        )  # fmt: skip
    return tree


def write_run(
    run_dir: Path,
    dispatch: tuple[int, ...] = (0, 1, 2, 3),
    update_s: float | None = None,
    ended: float | None = None,
    pipeline: int = 1,
) -> Path:
    """Two steps of a 2-cell run: 4 groups of 2; one execution (g3's) times out at 50 s.
    `dispatch`: the groups in the order the groups table says they were dispatched;
    `update_s`: each step's recorded update time (traces before 2026-12 have none);
    `ended`: seconds after its open each harness ended (`t_ended`; older traces: none);
    `pipeline`: the cells' recorded pipeline stages (`train.parallel.pipeline`)."""
    config = {**CONFIG, "train": {**CONFIG["train"], "parallel": {"pipeline": pipeline}}}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "trace.h5"
    now = [T0]
    with TraceWriter(path, run_meta={"config": yaml.safe_dump(config)},
                     clock=lambda: now[0]) as w:  # fmt: skip
        for g in range(4):
            start = T0 + 1.0 + 20.0 * g
            at = T0 + 1.0 + 20.0 * dispatch.index(g)
            w.append("groups", [{"group_id": f"g{g}", "task_id": "t", "execution_id": f"g{g}-e{e}",
                                 "policy_version": 0, "t_dispatch": at} for e in range(2)])  # fmt: skip
            for e in range(2):
                eid = f"g{g}-e{e}"
                now[0] = start
                w.open_execution(eid, {"group": f"g{g}"})
                now[0] = start + 12.0  # closed after a 3 s (e0) or 1 s (e1) evaluation
                timed_out = g == 3 and e == 1
                calls = [(1.0, 4.0, 100), (5.0, 9.0 + 2 * e, 100)]  # 2 calls, 6-7 s generating
                meta = {"verdict": "scored", "reward": 0.5}
                if ended is not None:
                    meta["t_ended"] = start + ended
                w.close_execution(eid, _tree(eid, start, calls),
                                  status="timed_out" if timed_out else "completed",
                                  meta=meta)  # fmt: skip
        w.append("steps", [{"step": s, "t": T0 + 60.0 * s, "name": n, "value": v}
                           for s in (1, 2) for n, v in (("elapsed_s", 60.0 * s),
                           ("prepass_s", 1.0), ("gradient_s", 3.0), ("microsteps", 2.0),
                           ("train_cells", 1.0), ("train_wall_s", 4.5))])  # fmt: skip
        if update_s is not None:
            w.append("steps", [{"step": s, "t": T0 + 60.0 * s, "name": "update_s",
                                "value": update_s} for s in (1, 2)])  # fmt: skip
        w.append("events", [
            {"t": T0, "kind": "admit", "detail": json.dumps({"group": "g0", "batch": 0})},
            {"t": T0, "kind": "admit", "detail": json.dumps({"group": "g1", "batch": 1})},
            {"t": T0, "kind": "publish", "detail": json.dumps({"version": 1, "seconds": 0.8})},
        ])  # fmt: skip
        w.append("roles", [
            {"cell": 0, "role": "to_train", "t_start": T0 + 10, "t_end": T0 + 12},
            {"cell": 1, "role": "to_train", "t_start": T0 + 10, "t_end": T0 + 14},
            {"cell": 1, "role": "to_rollout", "t_start": T0 + 20, "t_end": T0 + 21},
        ])  # fmt: skip
    return run_dir


def test_fit_reads_the_run_s_own_figures(tmp_path: Path) -> None:
    run = read_run(write_run(tmp_path / "run"))
    assert len(run.executions) == 8 and len(run.steps) == 2
    x = next(x for x in run.executions if x.group == "g0")
    assert x.run_s == pytest.approx(9.0) and x.calls == 2  # open at +0, last call ends at +9
    assert x.eval_s == pytest.approx(3.0)
    assert sum(x.timed_out for x in run.executions) == 1
    f = fit(run)
    costs, sched = f.template["costs"], f.template["scheduler"]
    assert costs["switch_to_train_s"] == pytest.approx(3.0)  # (2 + 4) / 2
    assert costs["switch_to_rollout_s"] == pytest.approx(1.0)
    assert costs["publish_s"] == pytest.approx(0.8)
    assert costs["prepass_ratio"] == pytest.approx(1 / 3)
    tokens_g0 = sum(x.tokens for x in run.executions if x.group in ("g0", "g1"))
    assert costs["train_tokens_per_node_s"] == pytest.approx(tokens_g0 / 6.0)  # 2 x 3 s
    assert costs["microstep_tokens"] == pytest.approx(tokens_g0 / 4.0)
    assert costs["update_s"] == pytest.approx(0.5)  # 4.5 s wall - (1 + 3) s of passes
    # a trace that records the update's own time: that, not the window beyond the passes
    # (which also holds a streaming batch's wait for its late groups)
    recorded = fit(read_run(write_run(tmp_path / "run2", update_s=0.2)))
    assert recorded.template["costs"]["update_s"] == pytest.approx(0.2)
    assert sched["cells"] == 2 and sched["concurrency_per_cell"] == 2
    assert sched["window"] == 1  # window auto, no pipeline: one micro-step a pass
    staged = fit(read_run(write_run(tmp_path / "run3", pipeline=3))).template["scheduler"]
    assert staged["window"] == 6  # auto for the run's 3 stages: what its cells claimed
    assert f.template["workload"]["harness_timeout_h"] == pytest.approx(50 / 3600)
    assert f.recorded["wall_s"] == 120.0 and len(f.groups) == 4
    assert f.groups[3].nominal_s[1] > 50.0  # the timeout stays a timeout in the replay


def test_an_executions_run_time_ends_where_its_harness_ended(tmp_path: Path) -> None:
    """The slot is busy until the harness exits, through its tool work after its last model
    call; only the rest to the close is evaluation (a trace without `t_ended`: the last call)."""
    run = read_run(write_run(tmp_path / "run", ended=11.5))
    g0 = [x for x in run.executions if x.group == "g0"]
    assert [x.run_s for x in g0] == pytest.approx([11.5, 11.5])  # last calls end at +9, +11
    assert [x.eval_s for x in g0] == pytest.approx([0.5, 0.5])
    assert fit(run).groups[0].nominal_s.tolist() == pytest.approx([11.5, 11.5])
    # an end outside the execution's open..close is not a harness end: the last call counts
    late = read_run(write_run(tmp_path / "late", ended=13.0))
    assert [x.run_s for x in late.executions if x.group == "g0"] == pytest.approx([9.0, 11.0])


def test_a_recorded_timeout_times_out_in_the_replay_at_any_load(tmp_path: Path) -> None:
    """An engine below its concurrency limit runs executions faster than nominal; a recorded
    timeout must still end at the timeout, training on the tokens it recorded."""
    from gyre.config import load
    from gyre.sim.config import SimConfig
    from gyre.sim.simulator import Simulator
    from gyre.vocabulary import Outcome

    f = fit(read_run(write_run(tmp_path / "run")))
    template = {**f.template, "workload": {**f.template["workload"],
                                           "saturation_half_per_node": 1.0}}  # fmt: skip
    sim = Simulator(load(SimConfig, template, path="replay"), "elastic", steps=8,
                    groups=f.groups, in_order=True)  # fmt: skip
    sim.run()
    assert sim.pool.models[0].rate(1) > 1.2  # one execution alone on an engine: much faster
    timed_out = [x for x, o in enumerate(sim.outcome) if o is Outcome.TIMED_OUT]
    assert timed_out and all(x % 8 == 7 for x in timed_out)  # g3-e1, each time it comes
    x = timed_out[0]
    assert sim.end_t[x] - sim.launch_t[x] == pytest.approx(50.0)
    recorded = next(r for r in read_run(tmp_path / "run").executions if r.timed_out)
    assert sim.tokens[x] == pytest.approx(recorded.tokens, rel=0.5)


def test_replay_cli_prints_the_fit_beside_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = write_run(tmp_path / "run")
    assert main(["sim", "--replay", str(run_dir), "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "mean execution s" in out and "switch to train s" in out
    assert "wall time: run 120.0 s, replay (recorded groups)" in out
    assert main(["sim", "--replay", str(run_dir / "trace.h5"), "--json", "--seed", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recorded"]["executions"] == 8 and len(data["replay_wall_s"]) == 1
    # any other topology on the fit
    assert main(["sim", "--replay", str(run_dir), "scheduler.cells=1", "scheduler.nodes=1",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["policies"]["elastic"]["total_h"] > 0


def test_an_in_order_replay_meets_the_runs_groups_in_dispatch_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gyre.sim.workload import EmpiricalWorkload

    f = fit(read_run(write_run(tmp_path / "run", dispatch=(3, 0, 1, 2))))
    assert f.groups[0].nominal_s[1] > 50.0  # g3, the group with the timeout, went first
    drawn = EmpiricalWorkload(f.groups, seed=0, in_order=True)
    assert [drawn.sample_group() for _ in range(6)] == [*f.groups, *f.groups[:2]]  # then again
    run_dir = tmp_path / "run"
    assert main(["sim", "--replay", str(run_dir), "--in-order", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["replay_wall_s"]) == 1  # no draw to average
    for extra in (["scheduler.cells=1"], ["--policy", "async"], ["--sweep", "phi=0,1"]):
        assert main(["sim", "--replay", str(run_dir), "--in-order", *extra]) == 2
        assert "--in-order: replays the run as it ran" in capsys.readouterr().err
    assert main(["sim", str(tmp_path / "any.yaml"), "--in-order"]) == 2
    assert "give --replay RUN too" in capsys.readouterr().err


def test_corrupt_or_foreign_files_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import h5py

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1]
    trace = write_run(tmp_path / "run") / "trace.h5"
    cut = tmp_path / "cut.h5"
    cut.write_bytes(trace.read_bytes()[:3000])
    for bad, message in ((text, "cannot open as HDF5"), (foreign, "not a Gyre trace"),
                         (cut, "truncated"), (tmp_path / "missing", "no such trace")):  # fmt: skip
        assert main(["sim", "--replay", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        with pytest.raises(StoreError):
            read_run(bad)
    assert main(["sim", str(trace)]) == 2  # a trace given as a template
    assert "use --replay" in capsys.readouterr().err
