"""`gyre trace stats`: staleness, tokens, tree shape, outcomes and switches of a run.

A hand-built trace whose every statistic is known checks the numbers exactly; one real
`gyre run` checks the command (table and --json) and the report's plots on a real trace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre.trajectory.reader import TraceReader
from gyre.trajectory.stats import plot_stats, run_stats
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import Provenance, TrajectoryTree

P = Provenance


def tree(eid: str, calls: list[tuple[int, list[int], int, int, str, int]]) -> TrajectoryTree:
    """Calls as (parent, input provenance codes, output tokens, policy version, role, attempts)."""
    t = TrajectoryTree(eid)
    for parent, prov, n_out, version, role, attempts in calls:
        t.add_node(parent_id=parent, input_ids=np.arange(len(prov)), input_provenance=prov,
                   output_ids=np.arange(n_out), output_logprobs=np.zeros(n_out, np.float32),
                   role=role, policy_version=version, engine_id="e0", t_start=1.0, t_end=2.0,
                   finish_reason="stop", input_key=b"", output_key=b"", attempts=attempts)  # fmt: skip
    return t


TREES = {
    "g0-e0": tree("g0-e0", [(0, [P.SYSTEM] * 4 + [P.USER] * 2, 3, 0, "main", 1),
                            (1, [P.TOOL] * 5, 2, 1, "main", 2)]),
    "g0-e1": tree("g0-e1", [(0, [P.SYSTEM] * 4 + [P.USER], 4, 0, "main", 1)]),
    "g1-e0": tree("g1-e0", [(0, [P.SYSTEM] * 3, 1, 1, "main", 1),
                            (1, [P.TOOL] * 2, 1, 1, "main", 1),
                            (1, [P.TEMPLATE], 5, 1, "compaction", 3)]),
    "g1-e1": TrajectoryTree("g1-e1"),
}  # fmt: skip
OUTCOMES = {  # status, reward (None: no valid score)
    "g0-e0": ("completed", 1.0),
    "g0-e1": ("timed_out", 0.5),
    "g1-e0": ("timed_out", 0.0),
    "g1-e1": ("not_launched", None),
}
EVENTS = [("admit", {"group": "g0", "batch": 0, "staleness": 1}),
          ("admit", {"group": "g1", "batch": 1, "staleness": 0}),
          ("switch", {"cell": 0, "to": "train", "seconds": 0.5}),
          ("switch", {"cell": 0, "to": "rollout", "seconds": 0.25}),
          ("reroute", {"execution": "g0-e0"}), ("reroute", {"execution": "g1-e0"}),
          ("publish", {"version": 1}), ("engine_lost", {"engine": 2})]  # fmt: skip


def write_trace(path: Path) -> None:
    with TraceWriter(path, run_meta={}) as w:
        for eid, t in TREES.items():
            g = eid[:2]
            w.append("groups", [{"group_id": g, "task_id": "add", "execution_id": eid,
                                 "policy_version": int(g[1]), "t_dispatch": 0.0}])  # fmt: skip
            status, reward = OUTCOMES[eid]
            w.open_execution(eid, {"group": g})
            verdict = "excluded" if reward is None else "scored"
            w.close_execution(eid, t, status=status, meta={"verdict": verdict})
            r = float("nan") if reward is None else reward  # as the runtime records it
            w.append("rewards", [{"execution_id": eid, "group_id": g, "reward": r,
                                  "valid": reward is not None, "t": 0.0}])  # fmt: skip
        w.append("assessments", [
            {"execution_id": "g0-e1", "attempt": a, "score": 0.5, "valid": a == 2, "state_ref": "",
             "evaluator": "final", "detail": "", "t": 0.0, "critique": ""} for a in (1, 2)])  # fmt: skip
        w.append("events", [{"t": 0.0, "kind": k, "detail": json.dumps(d)} for k, d in EVENTS])
        w.append("events", [{"t": 0.0, "kind": "note", "detail": "not json"}])
        w.append("roles", [{"cell": 0, "role": "rollout", "t_start": 0.0, "t_end": 10.0},
                           {"cell": 0, "role": "train", "t_start": 10.0, "t_end": 15.0},
                           {"cell": 1, "role": "rollout", "t_start": 0.0, "t_end": 15.0}])  # fmt: skip
        w.append("steps", [{"step": s, "t": 0.0, "name": f"staleness_{k}", "value": v}
                           for s, k, v in ((1, "mean", 1.0), (1, "max", 1.0), (2, "mean", 0.0),
                                           (2, "max", 0.0))])  # fmt: skip


def test_known_trace_gives_known_statistics(tmp_path: Path) -> None:
    write_trace(tmp_path / "trace.h5")
    s = run_stats(tmp_path)
    assert (s["executions"], s["open_executions"], s["steps"]) == (4, 0, 2)

    st = s["staleness"]
    assert st["groups"] == {"admitted": 2, "histogram": {"0": 1, "1": 1}, "mean": 0.5, "max": 1.0}
    assert st["steps"] == [
        {"step": 1, "mean": 1.0, "max": 1.0},
        {"step": 2, "mean": 0.0, "max": 0.0},
    ]
    # g0 trained at version 0 + 1: its version-0 calls lag 1 (3 + 4 tokens), version 1 lags 0
    assert st["token_lag"] == {"0": 2 + 1 + 1 + 5, "1": 3 + 4}

    tok = s["tokens"]
    assert tok["by_role"]["compaction"] == {**dict.fromkeys(tok["by_provenance"], 0),
                                            "template": 1, "policy": 5}  # fmt: skip
    assert tok["by_provenance"]["system"] == 11 and tok["by_provenance"]["policy"] == 16
    assert tok["total"] == sum(t.stats().unique_tokens for t in TREES.values()) == 38

    tr = s["trees"]
    assert (tr["executions_with_calls"], tr["nodes"], tr["leaves"]) == (3, 6, 4)
    assert tr["depth"] == {"mean": 5 / 3, "max": 2.0} and tr["depth_histogram"] == {"1": 1, "2": 2}
    assert (tr["branch_points"], tr["max_children"]) == (1, 2)
    assert tr["flat_tokens"] == sum(t.stats().flat_tokens for t in TREES.values())
    assert tr["flat_over_stored"] == pytest.approx(tr["flat_tokens"] / 38)

    o = s["outcomes"]
    assert o["by_status"]["timed_out"] == {"executions": 2, "scored": 2, "reward_mean": 0.25,
                                           "zero": 1, "partial": 1, "full": 0}  # fmt: skip
    assert o["by_status"]["not_launched"]["scored"] == 0
    assert (o["timeouts"], o["timeouts_scored"], o["timeouts_partial"]) == (2, 2, 1)
    assert o["verdicts"] == {"excluded": 1, "scored": 3}
    assert o["assessments"] == {"attempts": 2, "invalid": 1, "retried_executions": 1}

    sc = s["scheduling"]
    assert (sc["switches"], sc["switches_by_target"]) == (2, {"rollout": 1, "train": 1})
    assert sc["switch_seconds"] == {"mean": 0.375, "max": 0.5}
    assert (sc["reroutes"], sc["retried_calls"], sc["extra_attempts"]) == (2, 2, 3)
    assert (sc["publications"], sc["engine_losses"]) == (1, 1)
    assert sc["train_share"] == pytest.approx(5 / 30)
    json.dumps(s, allow_nan=False)  # plain JSON


def test_plots_are_written(tmp_path: Path) -> None:
    write_trace(tmp_path / "trace.h5")
    paths = plot_stats(run_stats(tmp_path), tmp_path / "report")
    names = ["stats_staleness.png", "stats_tokens.png", "stats_trees.png", "stats_outcomes.png"]
    assert [p.name for p in paths] == names
    assert all(
        p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths
    )


def test_report_page_states_the_evaluations_and_the_summary_readably(tmp_path: Path) -> None:
    """`gyre report`'s page: a table of the held-out evaluations as `gyre eval` recorded them
    (oldest policy first), the summary with numbers rounded and mappings as rows — no Python
    repr (`{`, `[`, `None`, long floats) anywhere a reader looks."""
    import re

    from gyre.runtime.evaluation import EvalResult, _merge
    from gyre.runtime.report import write_report

    write_trace(tmp_path / "trace.h5")
    final = EvalResult("final", 2, "m", rewards={"a": 1.0, "b": 0.5, "c": None})
    initial = EvalResult("initial", 0, "m", rewards={"a": 0.0, "b": 0.25, "c": 0.5})
    _merge(tmp_path / "eval.json", [final, initial], ["add"], 3)
    summary = {"steps_done": 2, "wall_s": 12.345678, "resumed_from": None, "policies": ["p/final"],
               "cell_hosts": [["n1", "n2"], ["n3", "n4"]]}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()

    evals = page[page.index("<table class='evals'>") :]
    evals = evals[: evals.index("</table>")]
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(<td>.*?)</tr>", evals)]
    assert rows == [["initial", "0", "3", "0", "0.25", "0.25"],
                    ["final", "2", "2", "1", "0.75", "0.3536"]]  # fmt: skip
    summary_table = page[page.index("<table class='summary'>") :]
    cells = dict(re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", summary_table))
    assert cells["steps_done"] == "2" and cells["wall_s"] == "12.35"
    assert cells["resumed_from"] == "—" and cells["policies"] == "p/final"
    assert cells["cell 0"] == "0.333" and cells["cell 1"] == "0"  # train_share, 5 of 15 s
    assert "0: n1, n2<br>1: n3, n4" in summary_table
    text = re.sub(r"<style>.*?</style>|<[^>]+>", " ", page, flags=re.S)
    assert not re.search(r"[{}\[\]]|None|\d\.\d{6}", text), text


@pytest.mark.slow
@pytest.mark.mpi
def test_stats_of_a_real_run(run_dir: Path, tmp_path: Path) -> None:
    def gyre(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "gyre", "trace", "stats", str(run_dir), *args],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    s = json.loads(gyre("--json"))
    with TraceReader(run_dir / "trace.h5") as reader:
        infos = reader.executions()
        kinds = [e["kind"] for e in reader.rows("events")]
    assert s["executions"] == len(infos) and s["steps"] == 2
    assert (
        s["tokens"]["total"] == s["trees"]["stored_tokens"] == sum(i.unique_tokens for i in infos)
    )
    assert s["tokens"]["by_role"]["main"]["policy"] > 0
    assert s["trees"]["nodes"] == sum(i.num_nodes for i in infos)
    assert s["scheduling"]["switches"] == kinds.count("switch") >= 1
    assert s["scheduling"]["role_seconds"]["train"] > 0
    assert sum(r["executions"] for r in s["outcomes"]["by_status"].values()) == len(infos)
    assert [step["step"] for step in s["staleness"]["steps"]] == [1, 2]
    table = gyre()
    for title in (
        "staleness",
        "stored tokens by role",
        "trajectory trees",
        "outcomes",
        "scheduling",
    ):
        assert title in table
    assert len(plot_stats(s, tmp_path / "report")) == 4
