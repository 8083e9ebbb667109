"""End to end: `gyre run` on a small config, one real MPI world, with a cell's engine SIGKILLed.

One run (about a minute on 2 cores; tests/worlds.py, shared with the trace export and stats
tests) checks what a user relies on:

* the run completes S steps and exits 0; zero harness-side errors; some update carried a
  learning signal (non-zero gradient and objective);
* the trace holds every dispatched execution with its tree, reward and validity — those
  whose evaluator crashes are marked invalid (excluded) with the evaluator's message, and
  their groups are set aside from training and counted;
* the role timeline shows a cell going rollout -> train -> rollout while executions are live,
  and each switch's duration is recorded; a cell leaving for training hands its rerouted
  executions' KV cache to their new engines (migrated, not recomputed);
* cell 2's engine is killed with SIGKILL mid-run: the loss is recorded, its calls are retried
  elsewhere (recorded with their engine attempts, one node per agent call), every harness
  finishes, the run completes;
* every configured tracker (TensorBoard, W&B offline, MLflow) holds each step's metrics;
* the final policy is a Hugging Face model directory: transformers loads it and
  `gyre engine --model DIR` serves it;
* `gyre report` renders the PNG plots and the HTML page, whose numbers are the run's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from worlds import World

from gyre.trajectory.store import TraceReader

from .conftest import final_policy_loads_and_serves, run_to_end, small_config


@pytest.mark.mpi
@pytest.mark.slow
def test_gyre_run_end_to_end_with_engine_kill(e2e_run: World) -> None:
    run_dir = e2e_run.run_dir
    assert e2e_run.returncode == 0, e2e_run.output[-4000:]
    assert e2e_run.engine_killed, "the run ended before cell 2's engine could be killed"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2
    assert summary["harness_errors"] == 0
    assert summary["engine_losses"] == 1
    _startup_profile_covers_every_rank(summary["startup"], e2e_run.output)

    with TraceReader(run_dir / "trace.h5") as r:
        meta = r.run_meta
        steps = r.rows("steps")
        execs = {i.execution_id: i for i in r.executions()}
        groups = r.rows("groups")
        rewards = {row["execution_id"]: row for row in r.rows("rewards")}
        roles = r.rows("roles")
        events = r.rows("events")
        assessments = r.rows("assessments")
        trees = {eid: r.tree(eid) for eid, i in execs.items() if i.status != "not_launched"}

    # which Gyre wrote it, and for which model
    assert meta["gyre_version"] and meta["model"] == "tiny", meta
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", meta["git_commit"]), meta["git_commit"]

    # every dispatched execution: a closed tree, a reward row, validity
    dispatched = {g["execution_id"]: g["task_id"].split("@")[0] for g in groups}
    assert set(dispatched) == set(execs) == set(rewards)
    assert all(i.closed for i in execs.values())
    for eid, task in dispatched.items():
        status = execs[eid].status
        if status == "not_launched":
            assert not rewards[eid]["valid"]
        elif task == "crashy":  # the evaluator crashed on every attempt: excluded, no reward
            assert not rewards[eid]["valid"] and execs[eid].meta["verdict"] == "excluded"
            assert "evaluator bug 42" in execs[eid].meta["error"]
        else:  # scored, timed-out and cancelled ones included
            assert rewards[eid]["valid"], (eid, status, execs[eid].meta)
            if task == "notes":  # the reward is the checker's score of the preserved workspace
                ws = run_dir / "workspaces" / eid / "workspace"
                assert rewards[eid]["reward"] == pytest.approx(_notes_score(ws)), eid
    assert any(t == "crashy" and execs[e].status != "not_launched" for e, t in dispatched.items())
    assert {a["execution_id"] for a in assessments} >= {
        e for e, i in execs.items() if i.status != "not_launched"
    }

    # the batches carried a learning signal
    metric: dict[str, list[float]] = {}
    for row in steps:
        metric.setdefault(row["name"], []).append(row["value"])
    assert len(metric["grad_norm"]) == 2 and max(metric["grad_norm"]) > 0, metric
    assert any(abs(v) > 0 for v in metric["objective"]), metric["objective"]

    # valid groups: a group whose evaluator crashed on every execution has no usable outcome;
    # it is set aside (trains nothing) and counted, every other admitted group trains
    task_of_group = {g["group_id"]: g["task_id"].split("@")[0] for g in groups}
    admitted = [json.loads(e["detail"])["group"] for e in events if e["kind"] == "admit"]
    crashy = sum(task_of_group[g] == "crashy" for g in admitted)
    assert summary["set_aside_groups"] == crashy == sum(metric["set_aside_groups"]), admitted
    aside = {json.loads(e["detail"])["group"] for e in events if e["kind"] == "set_aside"}
    assert aside == {g for g in admitted if task_of_group[g] == "crashy"}, aside

    # one node per agent call, also for calls whose engine was killed or switched away
    for eid, tree in trees.items():
        stdout = run_dir / "workspaces" / eid / "stdout.log"
        if execs[eid].status == "completed":
            report = json.loads(stdout.read_text().strip().splitlines()[-1])["report"]
            assert len(tree) == sum(report["calls"].values()), eid
            # its harness's end, after its last call, before its close: the replay's run time
            last_call = max((n.t_end for n in tree.nodes), default=execs[eid].t_open)
            assert last_call <= execs[eid].meta["t_ended"] <= execs[eid].t_close, eid

    # the engine loss is recorded; the calls it was serving needed a second engine attempt,
    # and every such call was recorded once, served by a live engine
    kinds = [e["kind"] for e in events]
    assert "engine_lost" in kinds and "engine_restarted" in kinds
    # the executions it was serving went on: each one's later calls were served (by another
    # engine, or by the restarted one after a retry), and it closed like any other
    assert e2e_run.live_on_killed, "the engine was killed while it served nobody"
    moved = 0
    for eid in e2e_run.live_on_killed:
        later = [n for n in trees[eid].nodes if n.t_start > e2e_run.kill_t]
        assert execs[eid].status != "failed", (eid, execs[eid].meta)  # the loss is not its failure
        moved += any(n.engine_id != "e2" or n.attempts > 1 for n in later)
    assert moved, "no call of the killed engine's executions was retried or served elsewhere"
    switches = [json.loads(e["detail"]) for e in events if e["kind"] == "switch"]
    assert switches and all(s["seconds"] > 0 for s in switches)
    # a cell leaving for training hands its rerouted executions' KV to their new engines
    # (§4.3): the cached prefix moves instead of being recomputed
    moved_kv = [s for s in switches if s["to"] == "train" and s.get("kv_migrated", 0) > 0]
    assert moved_kv and all(s["kv_tokens"] > 0 for s in moved_kv), switches

    # a cell went rollout -> train -> rollout while executions were live
    assert _round_trip_while_live(roles, execs)

    final_policy_loads_and_serves(run_dir / "policies" / "final", version=2)

    # every tracker got each step's metrics, as the trace has them
    _trackers_have_the_steps(run_dir, steps)

    # gyre report renders, and its page states the run's numbers
    rep = subprocess.run([sys.executable, "-m", "gyre", "report", str(run_dir)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    for name in ("timeline.png", "train_share.png", "steps.png", "durations.png", "index.html"):
        assert (run_dir / "report" / name).stat().st_size > 0
    page = dict(re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>",  # train_share: rows
                           (run_dir / "report" / "index.html").read_text()))  # fmt: skip
    assert page["steps_done"] == "2" and page["engine_losses"] == "1"
    assert page["harness_errors"] == "0"
    expected = {f"cell {c}": round(s, 3) for c, s in _train_share(roles).items()}
    assert {c: float(page[c]) for c in expected} == expected  # the train_share rows
    assert max(expected.values()) > 0


def _train_share(roles: list[dict]) -> dict[int, float]:
    """Per cell: seconds in the train role over seconds in any role, recounted from the trace."""
    total: dict[int, float] = {}
    train: dict[int, float] = {}
    for r in roles:
        total[r["cell"]] = total.get(r["cell"], 0.0) + r["t_end"] - r["t_start"]
        if r["role"] == "train":
            train[r["cell"]] = train.get(r["cell"], 0.0) + r["t_end"] - r["t_start"]
    return {c: train.get(c, 0.0) / t for c, t in sorted(total.items())}


def _trackers_have_the_steps(run_dir: Path, rows: list[dict]) -> None:
    """TensorBoard, W&B (offline) and MLflow each hold grad_norm and reward_mean of steps 1-2
    (as train/grad_norm and rollout/reward_mean), read back with the trackers' own readers
    (tests/test_tracking.py)."""
    from mlflow.tracking import MlflowClient
    from test_tracking import tensorboard_scalars, wandb_records

    from gyre.runtime.coordinator.progress import tags

    want: dict[str, dict[int, float]] = {"grad_norm": {}, "reward_mean": {}}
    for row in rows:
        if row["name"] in want:
            want[row["name"]][int(row["step"])] = float(row["value"])
    assert all(sorted(steps) == [1, 2] for steps in want.values()), want
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    history = {r["history"]["step"]["num"]: r["history"]["item"]
               for r in wandb_records(run_dir) if r["type"] == "history"}  # fmt: skip
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gyre").experiment_id])
    for name, steps in want.items():
        (tag,) = tags({name: 0.0})  # train/grad_norm, rollout/reward_mean
        assert scalars[tag] == pytest.approx(steps), ("tensorboard", tag)
        assert {s: history[s][tag] for s in steps} == pytest.approx(steps), ("wandb", tag)
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert logged == pytest.approx(steps), ("mlflow", tag)


def _notes_score(workspace: Path) -> float:
    from gyre.tasks.suite import LEARN_DIR

    sys.path.insert(0, str(LEARN_DIR / "notes" / "hidden"))
    import check_notes

    texts = check_notes.notes(workspace, LEARN_DIR / "notes" / "workspace")
    bullets = sum(check_notes.is_bullet(t) for t in texts)
    return min(1.0, (0.25 * len(texts) + 0.75 * bullets) / 2)


def _round_trip_while_live(roles: list[dict], execs: dict) -> bool:
    by_cell: dict[int, list[dict]] = {}
    for row in sorted(roles, key=lambda r: r["t_start"]):
        by_cell.setdefault(row["cell"], []).append(row)
    for rows in by_cell.values():
        names = [r["role"] for r in rows]
        for i, row in enumerate(rows):
            if row["role"] != "train" or "rollout" not in names[:i] or "rollout" not in names[i:]:
                continue
            live = [
                e for e in execs.values()
                if e.t_close is not None and e.t_open < row["t_end"] and e.t_close > row["t_start"]
            ]  # fmt: skip
            if live:
                return True
    return False


def _colocate_run(tmp_path: Path, cfg: dict, name: str) -> Path:
    return run_to_end(tmp_path, cfg, name)


def _step_metrics(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """(metric -> step -> value, execution -> reward) as the trace records them."""
    with TraceReader(run_dir / "trace.h5") as r:
        steps, rewards = r.rows("steps"), r.rows("rewards")
    metrics: dict[str, dict[int, float]] = {}
    for row in steps:
        metrics.setdefault(row["name"], {})[int(row["step"])] = float(row["value"])
    # an excluded execution's reward is NaN (never equal to itself): compared as None
    return metrics, {r["execution_id"]: None if r["reward"] != r["reward"] else float(r["reward"])
                     for r in rewards}  # fmt: skip


def _startup_profile_covers_every_rank(startup: dict, output: str) -> None:
    """`--profile-startup`: the summary's `startup` has every rank's phases, which add up to
    when it served; the coordinator's to the first step; the printed table has a column per
    rank and a row per phase."""
    ranks = {r["rank"]: r for r in startup["ranks"]}
    assert sorted(ranks) == list(range(5)), ranks  # coordinator, proxy, three cells
    assert [ranks[r]["component"] for r in range(5)] == [
        "coordinator", "proxy", "cell0", "cell1", "cell2"]  # fmt: skip
    for r in ranks.values():  # each forked from gyre run's rank zygote (topology.zygote)
        assert {"gyre run", "launch", "rank zygote", "imports", "rendezvous",
                "transport"} <= set(r["phases"])  # fmt: skip
        assert all(v >= 0 for v in r["phases"].values()), r
    for cell in (2, 3, 4):  # each forks its engine from its zygote (engine.zygote)
        assert {"zygote", "engine spawn", "model build", "engine ready"} <= set(
            ranks[cell]["phases"]
        )
    assert "proxy start" in ranks[1]["phases"]
    coordinator = ranks[0]["phases"]
    assert list(coordinator)[-2:] == ["first group", "first batch"]
    assert sum(coordinator.values()) == pytest.approx(startup["first_step_s"], abs=0.01)
    served = max(sum(r["phases"].values()) for r in ranks.values() if r["rank"] > 0)
    assert 0 < served < startup["first_step_s"]
    lines = output[output.index("gyre run: start-up") :].splitlines()
    assert lines[1].split()[1:] == ["0", "coord", "1", "proxy", "2", "cell0", "3", "cell1",
                                    "4", "cell2"]  # fmt: skip
    rows = {line.split("  ")[0].strip(): line for line in lines[2:] if line.strip()}
    assert {p for r in ranks.values() for p in r["phases"]} <= set(rows), rows
    assert len(rows["total"].split()) == 1 + 5  # a total for every rank
    assert f"{startup['first_step_s']:.2f}" in rows["first step"]


@pytest.mark.mpi
@pytest.mark.slow
def test_colocate_cells_serve_the_publication_they_were_released_for(tmp_path: Path) -> None:
    """Colocate trains on every cell and publishes while all engines are released: each
    cell's engine must come back serving the new weights (a satellite once came back with
    its old ones, so two thirds of the rollouts never saw a trained policy).

    And a colocate run is repeatable: with φ = 0, μ = 1 every step trains exactly the B
    groups dispatched for it, every rollout runs on the policy of its step, and every
    sampled call's seed derives from the run seed, the execution and the call — so a second
    run of the same config gives the same per-step and per-execution rewards. Gradient
    sums agree to rounding, not bit for bit: which cell claims which micro-step follows
    timing, and so does the order in which float gradients are added.

    The second run is paced (docs/pacing.md): pacing changes when things happen, never what
    is computed, so it learns exactly what the first did — and says it was paced."""
    cfg = small_config(tmp_path, steps=3)
    cfg["schedule"].update(policy="colocate", phi=0.0, mu=1)
    paced = json.loads(json.dumps(cfg))
    paced["pace"] = {"scale": 20, "calls": {"decode_s_per_token": 0.5}}
    runs = [_colocate_run(tmp_path, cfg, "run-a"), _colocate_run(tmp_path, paced, "run-b")]
    for run_dir in runs:
        with TraceReader(run_dir / "trace.h5") as r:
            events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
        published, returns = 0, []
        for kind, detail in events:
            if kind == "publish":
                published = detail["version"]
            elif kind == "switch" and detail["to"] == "rollout":
                returns.append((detail["cell"], detail["engine_version"], published))
        assert {c for c, _, p in returns if p > 0} == {0, 1, 2}, returns  # every cell came back
        assert all(served == p for _, served, p in returns), returns

    (a, rewards_a), (b, rewards_b) = (_step_metrics(run_dir) for run_dir in runs)
    assert len(a["reward_mean"]) == 3 and a["reward_mean"] == b["reward_mean"]
    assert len(rewards_a) == 3 * 8 and rewards_a == rewards_b  # B = 2 groups of N = 4 a step
    assert a["grad_norm"].keys() == b["grad_norm"].keys()
    for step, norm in a["grad_norm"].items():
        assert norm == pytest.approx(b["grad_norm"][step], rel=1e-4, abs=1e-6), step

    unpaced, summary = (json.loads((d / "summary.json").read_text()) for d in runs)
    assert "pace" not in unpaced
    pace = summary["pace"]
    assert pace["calls"]["work"] >= 3 * 8 and pace["calls"]["modelled_s"] > 0  # model calls
    assert pace["cell_work"]["work"] > 0  # switches, passes, updates, publications
    assert pace["paced_h"] == pytest.approx(summary["wall_s"] * 20 / 3600)
    # the devices took the modelled time: calls and cell work were held to it (those that
    # overran it could not be; comparing the two runs' wall times is noise on a loaded machine)
    assert pace["calls"]["overruns"] < pace["calls"]["work"]
    assert pace["cell_work"]["overruns"] < pace["cell_work"]["work"]
