"""Oversampling in `gyre run` (docs/scheduler.md "Oversampling"): every trained group trains
exactly N valid members, and an excluded execution is replaced by a surplus one.

* the key: `schedule.oversample` is an integer >= 0, 0 by default (a run as without it);
* the coordinator, on socket pairs (test_messages' `CoordinatorWorld`, the test playing the
  proxy node and the cells): an excluded verdict leaves its group waiting for a surplus
  execution's; a group whose N valid verdicts are in has its running surplus cancelled at
  the proxy node; the packing buffer gets the N members' outcomes only;
* one tiny job — two cells, groups of N = 2 plus k = 1 surplus execution, B = 2 groups, one
  step — on the learnable notes task, scored by the task's own checker behind a wrapper
  that crashes on the run's first scoring, once (one evaluator attempt per execution: that
  execution is excluded, "evaluator crashed"). Everything asserted is read from the run's
  public outputs: the trace's `groups`, `rewards` and `events` tables and `summary.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gyre.errors import ConfigError
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import DEFAULT_CONFIG, RunConfig, load_run_config
from gyre.runtime.shared.layout import PROXY_RANK
from gyre.tasks.suite import LEARN_DIR
from gyre.trajectory.reader import TraceReader
from gyre.vocabulary import Outcome, VerdictStatus

from . import test_messages
from .conftest import run_to_end, small_config, write_config

N, K, B = 2, 1, 2


def test_the_key_is_a_count_and_off_by_default(tmp_path: Path) -> None:
    path = write_config(tmp_path, small_config(tmp_path))
    cfg = load_run_config(path)
    assert cfg.schedule.oversample == 0
    assert cfg.schedule.scheduler(cfg.topology)[0].executions_per_group == cfg.schedule.group_size
    got = load_run_config(path, ["schedule.oversample=3"])
    assert (
        got.schedule.scheduler(got.topology)[0].executions_per_group == got.schedule.group_size + 3
    )
    with pytest.raises(
        ConfigError, match=r"run\.schedule\.oversample: -1; allowed: an integer >= 0"
    ):
        load_run_config(path, ["schedule.oversample=-1"])


def _oversampled(policy: str | None = None) -> RunConfig:
    return load_run_config(DEFAULT_CONFIG, [f"schedule.group_size={N}", f"schedule.oversample={K}",
                                            f"schedule.batch_groups={B}"], policy=policy)  # fmt: skip


def test_the_coordinator_replaces_the_excluded_and_cancels_the_surplus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_messages, "_config", _oversampled)
    world = test_messages.CoordinatorWorld(tmp_path)
    c = world.c
    events: list[tuple[str, dict]] = []
    record = c.rec.event
    monkeypatch.setattr(
        c.rec, "event", lambda kind, **d: (events.append((kind, d)), record(kind, **d))
    )
    started = world.take(msg.StartExecution, PROXY_RANK)
    assert [m.execution_id for m in started][: 2 * (N + K)] == [
        "g0-e0", "g0-e1", "g0-e2", "g1-e0", "g1-e1", "g1-e2"]  # fmt: skip

    def close(x: int, verdict: msg.VerdictRecord) -> None:
        eid = c.ledger.executions[x].id
        world.handle(msg.JournalNode(eid, test_messages._node(eid, [7, 8, 9])))
        world.handle(msg.HarnessEnded(x, Outcome.COMPLETED, 1.0, 2.0, ""))
        world.handle(msg.Assessed(x, verdict, 0))

    close(0, msg.VerdictRecord.excluded("evaluator crashed: bug", 2.0))  # g0-e0 excluded
    close(1, test_messages._verdict(1.0))
    assert c.sched.ready == []  # one valid of N = 2: g0 waits for its surplus execution
    close(2, test_messages._verdict(0.0))
    assert c.sched.ready == [(0, 0)] and not world.take(msg.Cancel)  # g0 ready, nothing left
    close(3, test_messages._verdict(1.0))
    close(4, test_messages._verdict(0.0))  # g1 has its N valid: g1-e2 is surplus
    assert world.take(msg.Cancel, PROXY_RANK) == [msg.Cancel(["g1-e2"])]
    assert ("surplus", {"execution": "g1-e2", "group": "g1", "action": "cancel"}) in events
    assert c.stats["surplus_cancelled"] == 1

    world.play(msg.Prepass)  # the core trains: both groups admitted, their N members only
    admits = {d["group"]: d for kind, d in events if kind == "admit"}
    assert admits["g0"]["members"] == ["g0-e1", "g0-e2"] and admits["g0"]["surplus"] == ["g0-e0"]
    assert admits["g1"]["members"] == ["g1-e0", "g1-e1"] and admits["g1"]["surplus"] == ["g1-e2"]
    assert ("replaced", {"execution": "g0-e0", "group": "g0"}) in events
    assert c.stats["excluded_replaced"] == 1
    assert set(c.train.buffer.batch_info().executions) == {"g0-e1", "g0-e2", "g1-e0", "g1-e1"}


def crash_once_suite(tmp_path: Path) -> Path:
    """The notes task; the first scoring of the run crashes (it leaves a marker), every other
    runs the notes checker."""
    notes = LEARN_DIR / "notes"
    marker = tmp_path / "crashed-once"
    wrapper = tmp_path / "crash_once.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "try:\n"
        "    os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY))\n"
        "except FileExistsError:\n"
        "    sys.argv = sys.argv[2:]\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "else:\n"
        "    raise SystemExit('evaluator bug: the first scoring of the run crashes')\n"
    )
    suite = {"name": "oversampling", "tasks": [{
        "name": "notes", "instruction": "Take notes: one file per note, each a bullet.",
        "workspace": str(notes / "workspace"),
        "scoring": {"rule": "command", "timeout_s": 30, "command": [
            "python3", str(wrapper), str(marker), str(notes / "hidden" / "check_notes.py"),
            "--initial", str(notes / "workspace")]},
    }]}  # fmt: skip
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def _run(tmp_path: Path) -> Path:
    cfg = small_config(tmp_path, steps=1)
    cfg["topology"]["cells"] = 2
    # two slots in all: the surplus of the later group is still queued or running when
    # its group completes (withdrawn or cancelled)
    cfg["schedule"].update(
        group_size=N, oversample=K, batch_groups=B, phi=0.0, mu=1, concurrency_per_cell=1
    )
    # sandbox none: the crash-once scorer keeps its marker across scorings, outside the
    # scratch copy, which a confined scorer cannot write (docs/tasks.md "Scoring rules")
    cfg["harness"].update(suite=str(crash_once_suite(tmp_path)), tasks=["notes"],
                          eval_attempts=1, sandbox="none")  # fmt: skip
    cfg["harness"]["params"].update({"max_turns": "2", "max_tokens": "96"})
    return run_to_end(tmp_path, cfg, timeout=240)


@pytest.mark.mpi
@pytest.mark.slow
def test_every_trained_group_has_n_valid_members_and_the_excluded_one_is_replaced(
    tmp_path: Path,
) -> None:
    run_dir = _run(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    with TraceReader(run_dir / "trace.h5") as r:
        groups = r.rows("groups")
        rewards = {row["execution_id"]: bool(row["valid"]) for row in r.rows("rewards")}
        events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
        status = {i.execution_id: i.status for i in r.executions()}
    assert summary["steps_done"] == 1

    of_group: dict[str, list[str]] = {}
    for row in groups:
        of_group.setdefault(row["group_id"], []).append(row["execution_id"])
    assert all(len(xs) == N + K for xs in of_group.values()), of_group  # N + k dispatched

    # the run's one exclusion: the crashed scoring
    excluded = [e for e, valid in rewards.items() if not valid and status[e] != "not_launched"]
    assert len(excluded) == 1, (rewards, status)
    crashed = [d["execution"] for kind, d in events if kind == "excluded"]
    assert crashed == excluded and status[excluded[0]] != "cancelled"

    admitted = {d["group"]: d for kind, d in events if kind == "admit"}
    assert len(admitted) == B  # the step trained both groups dispatched for it
    for g, d in admitted.items():
        assert len(d["members"]) == N and all(rewards[x] for x in d["members"]), d
        assert sorted(d["members"] + d["surplus"]) == sorted(of_group[g]), d
    # the excluded execution's group trained N valid members all the same: it was replaced
    (home,) = [g for g, xs in of_group.items() if excluded[0] in xs]
    assert excluded[0] in admitted[home]["surplus"], admitted[home]
    replaced = [d for kind, d in events if kind == "replaced"]
    assert replaced == [{"execution": excluded[0], "group": home}], replaced
    assert summary["excluded_replaced"] == 1

    # every surplus execution closed and never trained: cancelled, withdrawn, or it had
    # closed already; each one stopped is an event and counted in the summary
    stopped = [d for kind, d in events if kind == "surplus"]
    assert summary["surplus_cancelled"] == sum(d["action"] == "cancel" for d in stopped)
    assert summary["surplus_withdrawn"] == sum(d["action"] == "withdraw" for d in stopped)
    surplus = {x for d in admitted.values() for x in d["surplus"]}
    assert {d["execution"] for d in stopped} <= surplus
    assert all(status[x] != "open" for x in surplus), status  # each one closed in the trace


def test_a_carried_groups_members_follow_the_order_of_its_verdicts() -> None:
    """A resumed run's group enters ready (`AdmitGroup.members == ()`): the ledger applies
    the rule to the order its verdicts were given — the first N usable, then excluded ones."""
    from gyre.runtime.coordinator.ledger import Execution, ExecutionState, GroupRecord, Ledger

    def verdict(t: float, usable: bool = True) -> msg.VerdictRecord:
        if not usable:
            return msg.VerdictRecord.excluded("evaluator crashed", t)
        return msg.VerdictRecord(status=VerdictStatus.SCORED, reward=1.0, t=t)

    ledger = Ledger(N + K)
    for g, times in enumerate([(3.0, 1.0, 2.0), (1.0, 2.0, 3.0)]):
        ledger.add(GroupRecord(f"g{g}", "notes", 0, 0), [
            Execution(f"g{g}-e{i}", g, ExecutionState.RECORDED,
                      verdict=verdict(t, usable=(g, i) != (1, 0)))
            for i, t in enumerate(times)
        ])  # fmt: skip
    assert ledger.trained(0, N) == (1, 2)  # e1 and e2 were scored before e0
    assert ledger.trained(1, N) == (4, 5)  # e0 (first) was excluded: e1, e2 train
    assert ledger.trained(1, 3) == (3, 4, 5)  # 2 usable of 3 wanted: filled up with e0
