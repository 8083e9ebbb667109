"""HDF5 trace store: exact round trips, crash survival, live SWMR readers, refusal of bad input."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_child import expected_tree, tree_digest
from trajectory_strategies import TEXT, make_tree, trees

from gyre.errors import ConfigError, GyreError, StoreError
from gyre.trajectory.schema import Table
from gyre.trajectory.store import TraceInputError, TraceReader, TraceWriter, recover
from gyre.trajectory.tree import Node, Provenance, TrajectoryTree

CHILD = str(Path(__file__).with_name("trace_child.py"))


def unique_ids(ts: list[TrajectoryTree]) -> bool:
    return len({t.execution_id for t in ts}) == len(ts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(trees(max_nodes=8), max_size=4).filter(unique_ids),
    st.lists(st.integers(0, 9), min_size=4, max_size=4),
    st.dictionaries(TEXT, TEXT, max_size=3),
)
def test_round_trip_is_exact(ts: list[TrajectoryTree], journal: list[int], meta: dict) -> None:
    """Random trees (unicode ids/roles, empty inputs/outputs) read back equal, journaled or not."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.h5"
        with TraceWriter(path, run_meta={"config": "x: 1\n", "ü": meta}) as w:
            for t, k in zip(ts, journal):
                if k % 3:  # journal a prefix of the nodes first, as the proxy does
                    w.open_execution(t.execution_id, meta)
                    for node in t.nodes[: k % len(t) + 1 if len(t) else 0]:
                        w.record_node(t.execution_id, node)
                w.close_execution(t.execution_id, t, status="completed ✓", meta={"k": k})
        with TraceReader(path) as r:
            assert r.run_meta == {"config": "x: 1\n", "ü": meta}
            assert [i.execution_id for i in r.executions()] == [t.execution_id for t in ts]
            for t in ts:
                back = r.tree(t.execution_id)
                assert back.diff(t) == []
                info = next(i for i in r.executions() if i.execution_id == t.execution_id)
                s = t.stats()
                assert (info.num_nodes, info.unique_tokens, info.flat_tokens) == (
                    s.num_nodes, s.unique_tokens, s.flat_tokens)  # fmt: skip
                assert info.status == "completed ✓" and info.closed
            assert r.recover() == {}


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "step": st.integers(-(2**63), 2**63 - 1),
                "t": st.floats(allow_nan=False),
                "name": TEXT,
                "value": st.floats(),
            }
        ),
        max_size=20,
    )
)
def test_table_round_trip_is_exact(rows: list[dict]) -> None:
    with tempfile.TemporaryDirectory() as d:
        with TraceWriter(Path(d) / "t.h5", run_meta={}) as w:
            w.append("steps", rows)
            w.append("roles", [{"cell": 1, "role": "TRAIN", "t_start": 0.0, "t_end": 2.5}])
        with TraceReader(Path(d) / "t.h5") as r:
            back = r.rows("steps")
            assert len(back) == len(rows)
            for a, b in zip(back, rows):
                assert a["step"] == b["step"] and a["name"] == b["name"] and a["t"] == b["t"]
                assert a["value"] == b["value"] or (np.isnan(a["value"]) and np.isnan(b["value"]))
            assert r.rows("roles") == [{"cell": 1, "role": "TRAIN", "t_start": 0.0, "t_end": 2.5}]


def test_declared_tables_and_run_meta(tmp_path: Path) -> None:
    extra = Table("probes", (("name", "str"), ("ok", "bool"), ("n", "int")))
    with TraceWriter(tmp_path / "r.h5", run_meta={"config": "a: [1]\n"}, tables=[extra]) as w:
        w.append("probes", [{"name": "p", "ok": True, "n": 3}, {"name": "q", "ok": False, "n": 0}])
        w.append("assessments", [dict(execution_id="e", attempt=1, score=0.0, valid=True,
                                      state_ref="ws/e", evaluator="pytest", detail="", t=1.0,
                                      critique="meets the rubric")])  # fmt: skip
    with TraceReader(tmp_path / "r.h5") as r:
        cols = r.table("probes")
        assert cols["ok"].dtype == bool and cols["ok"].tolist() == [True, False]
        assert cols["name"].tolist() == ["p", "q"]
        a = r.rows("assessments")[0]
        assert a["valid"] is True and a["score"] == 0.0  # a valid zero is a real score
        assert a["critique"] == "meets the rubric"
        assert r.table_sizes()["probes"] == 2 and r.writer_closed
        with pytest.raises(StoreError, match="not in this file"):
            r.table("nope")


def _as_format_1_1(path: Path) -> None:
    """Rewrite a trace's `assessments` table as format 1.1 stored it: no `critique` column."""
    with h5py.File(path, "r+") as f:
        old = f["tables/assessments"]
        rows = old[:]
        cols = [c for c in old.attrs["columns"].split(",") if not c.startswith("critique:")]
        names = [c.split(":")[0] for c in cols]
        del f["tables/assessments"]
        ds = f.create_dataset(
            "tables/assessments",
            data=rows[names].astype(np.dtype([(n, rows.dtype[n]) for n in names])),
            maxshape=(None,),
            chunks=(64,),
        )
        ds.attrs["columns"] = ",".join(cols)
        f.attrs["format_version"] = "1.1"


def test_a_1_1_trace_reads_critiques_as_empty_and_continues(tmp_path: Path) -> None:
    row = dict(execution_id="e", attempt=1, score=0.5, valid=True, state_ref="", evaluator="final",
               detail="", t=1.0, critique="dropped by 1.1")  # fmt: skip
    path = tmp_path / "old.h5"
    with TraceWriter(path, run_meta={}) as w:
        w.append("assessments", [row])
    _as_format_1_1(path)
    with TraceReader(path) as r:
        assert r.format_version == "1.1"
        assert [a["critique"] for a in r.rows("assessments")] == [""]
        assert r.rows("assessments")[0]["score"] == 0.5
    with TraceWriter.reopen(path) as w:  # a resumed run keeps appending its rows
        w.append("assessments", [row | {"attempt": 2}])
    with TraceReader(path) as r:
        assert [(a["attempt"], a["critique"]) for a in r.rows("assessments")] == [(1, ""), (2, "")]


# -- crash survival ----------------------------------------------------------------------------


def _readline(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    ready = sel.select(timeout)
    sel.close()
    assert ready, "child process did not answer in time"
    return proc.stdout.readline()  # type: ignore[union-attr]


@pytest.mark.parametrize("kill_after", [12, 31])
def test_sigkilled_writer_leaves_closed_executions_readable(
    tmp_path: Path, kill_after: int
) -> None:
    path = tmp_path / "crash.h5"
    proc = subprocess.Popen([sys.executable, CHILD, "write", str(path)], stdout=subprocess.PIPE,
                            text=True, bufsize=1)  # fmt: skip
    closed: list[str] = []
    opened: list[str] = []
    journaled: dict[str, int] = {}
    try:
        while len(closed) < kill_after:
            line = _readline(proc)
            assert line, f"writer exited early with {proc.wait()}"
            word, eid, *rest = line.split()
            {"closed": closed, "opened": opened}.get(word, []).append(eid)
            if word == "journaled":
                journaled[eid] = int(rest[0])
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: the child never stops writing
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL

    with TraceReader(path) as r:
        assert not r.writer_closed
        infos = {i.execution_id: i for i in r.executions()}
        recovered = r.recover()
    for eid in opened:  # every execution the writer reported is in the file
        assert eid in infos, eid
    for eid, info in infos.items():
        want = expected_tree(int(eid.split("-")[1]))
        if info.closed:
            assert info.status == "completed" and info.meta["n"] == len(want)
            with TraceReader(path) as r:
                assert r.tree(eid).diff(want) == []
        else:  # clearly marked, and its journal is a prefix of the real tree
            assert info.status == "open" and eid not in closed
            part = recovered[eid]
            assert journaled.get(eid, 0) <= len(part) <= len(want)
            assert info.num_nodes == len(part)
            assert [n.node_id for n in part.nodes] == list(range(1, len(part) + 1))
            prefix = TrajectoryTree.from_dict({"execution_id": eid,
                                               "nodes": want.to_dict()["nodes"][: len(part)]})  # fmt: skip
            assert part.diff(prefix) == []
    assert set(closed) <= {e for e, i in infos.items() if i.closed}
    assert set(recovered) == {e for e, i in infos.items() if not i.closed}
    assert recover(path).keys() == recovered.keys()


@pytest.mark.parametrize("kill_after", [7, 23])
def test_a_killed_writers_trace_is_continued_in_place(tmp_path: Path, kill_after: int) -> None:
    """`TraceWriter.reopen` after SIGKILL: one trace; closed executions intact; appends work."""
    path = tmp_path / "crash.h5"
    proc = subprocess.Popen([sys.executable, CHILD, "write", str(path)], stdout=subprocess.PIPE,
                            text=True, bufsize=1)  # fmt: skip
    closed: list[str] = []
    try:
        while len(closed) < kill_after:
            word, eid, *_ = _readline(proc).split()
            if word == "closed":
                closed.append(eid)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    with TraceReader(path) as r:
        before = {i.execution_id: tree_digest(r.tree(i.execution_id))
                  for i in r.executions() if i.closed}  # fmt: skip
        still_open = {i.execution_id for i in r.executions() if not i.closed}
    assert set(closed) <= set(before) and still_open

    w = TraceWriter.reopen(path)
    assert set(w.open_executions) == still_open
    for eid in still_open:  # a resumed run closes what the dead writer left open
        w.close_execution(eid, TrajectoryTree(eid), status="unrecoverable")
    fresh = expected_tree(10_000)
    w.open_execution(fresh.execution_id, {"i": 10_000})
    for node in fresh.nodes:
        w.record_node(fresh.execution_id, node)
    w.close_execution(fresh.execution_id, fresh, status="completed")
    w.append("events", [{"t": 1.0, "kind": "resumed", "detail": "{}"}])
    w.close()
    with TraceReader(path) as r:
        assert r.writer_closed
        after = {i.execution_id: i for i in r.executions()}
        for eid, digest in before.items():
            assert tree_digest(r.tree(eid)) == digest, eid
        assert r.tree(fresh.execution_id).diff(fresh) == []
        assert {after[e].status for e in still_open} == {"unrecoverable"}
        assert [e["kind"] for e in r.rows("events")] == ["resumed"]


def test_reopen_cuts_a_torn_tail_back_to_what_is_consistent(tmp_path: Path) -> None:
    """Rows a crash left half-written (references past the data) are dropped on reopen."""
    import h5py

    from gyre.trajectory import schema as S

    path = tmp_path / "torn.h5"
    keep = expected_tree(1)
    with TraceWriter(path, run_meta={}) as w:
        w.close_execution(keep.execution_id, keep, status="completed")
    with h5py.File(path, "a", libver="latest") as f:  # a crash mid-append, simulated
        for name in (S.NODES, S.EXECUTIONS, S.STRINGS_END):
            ds = f[name]
            ds.resize((ds.shape[0] + 1,))
            ds[-1] = ds[-2]  # a row copied: it points past the data once shifted below
        ds = f[S.EXECUTIONS]
        row = ds[-1]
        row["node_start"] = f[S.NODES].shape[0] + 5
        ds[-1] = row
        ends = f[S.STRINGS_END]
        ends[-1] = f[S.STRINGS_DATA].shape[0] + 100
        ids = f[S.TOKEN_IDS]
        ids.resize((ids.shape[0] + 3,))  # tokens without their provenance
    w = TraceWriter.reopen(path)
    assert w.repaired == {S.STRINGS_END: 1, S.TOKEN_IDS: 3, S.EXECUTIONS: 1}
    extra = expected_tree(2)
    w.close_execution(extra.execution_id, extra, status="completed")
    w.close()
    with TraceReader(path) as r:
        assert [i.execution_id for i in r.executions()] == [keep.execution_id, extra.execution_id]
        assert r.tree(keep.execution_id).diff(keep) == []
        assert r.tree(extra.execution_id).diff(extra) == []


def test_reopen_refuses_what_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no trace to continue"):
        TraceWriter.reopen(tmp_path / "missing.h5")
    bogus = tmp_path / "bogus.h5"
    bogus.write_bytes(b"not hdf5 at all")
    with pytest.raises(StoreError, match="cannot reopen"):
        TraceWriter.reopen(bogus)


# -- live SWMR reader --------------------------------------------------------------------------


def test_swmr_reader_in_another_process_sees_later_closes(tmp_path: Path) -> None:
    path = tmp_path / "live.h5"
    w = TraceWriter(path, run_meta={})
    first = [expected_tree(i) for i in range(2)]
    later = [expected_tree(i) for i in range(2, 5)]
    for t in first:
        w.close_execution(t.execution_id, t, status="completed")
    w.open_execution(later[0].execution_id)
    w.record_node(later[0].execution_id, later[0].nodes[0])
    proc = subprocess.Popen([sys.executable, CHILD, "read", str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)  # fmt: skip
    try:
        proc.stdin.write("list\n")  # type: ignore[union-attr]
        seen = json.loads(_readline(proc))
        assert seen == {
            **{t.execution_id: ["completed", len(t), tree_digest(t)] for t in first},
            later[0].execution_id: ["open", 1, None],
        }
        for t in later:
            if t is not later[0]:
                w.open_execution(t.execution_id)
            w.close_execution(t.execution_id, t, status="timeout")
        proc.stdin.write("list\n")  # type: ignore[union-attr]
        seen = json.loads(_readline(proc))
        for t in later:
            assert seen[t.execution_id] == ["timeout", len(t), tree_digest(t)]
        assert len(seen) == 5
        proc.stdin.write("quit\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
        w.close()


# -- bad input ---------------------------------------------------------------------------------


def _snapshot(path: Path) -> str:
    with TraceReader(path) as r:
        doc = {
            "executions": [(i.execution_id, i.status, i.num_nodes) for i in r.executions()],
            "trees": {
                i.execution_id: r.tree(i.execution_id).to_dict() for i in r.executions() if i.closed
            },
            "open": {k: v.to_dict() for k, v in r.recover().items()},
            "tables": {name: r.rows(name) for name in r.tables},
        }
    return json.dumps(doc, sort_keys=True)


def _bad_node(base: Node, **changes: object) -> Node:
    fields = {k: getattr(base, k) for k in Node.__slots__}  # type: ignore[attr-defined]
    fields.update(changes)
    return Node(**fields)  # type: ignore[arg-type]


BAD_CALLS = {
    "open twice": lambda w, t: w.open_execution("live"),
    "open closed": lambda w, t: w.open_execution("done"),
    "meta not JSON": lambda w, t: w.open_execution("x", {"f": object()}),
    "record unknown execution": lambda w, t: w.record_node("ghost", t.nodes[0]),
    "record closed execution": lambda w, t: w.record_node("done", t.nodes[0]),
    "record out of order": lambda w, t: w.record_node("live", t.nodes[2]),
    "record unknown parent": lambda w, t: w.record_node("live", _bad_node(t.nodes[1], parent_id=7)),
    "record wrong dtype": lambda w, t: w.record_node(
        "live", _bad_node(t.nodes[1], input_ids=t.nodes[1].input_ids.astype(np.float64))),
    "record mismatched lengths": lambda w, t: w.record_node(
        "live", _bad_node(t.nodes[1], output_logprobs=np.zeros(999, np.float32))),
    "record oversize key": lambda w, t: w.record_node(
        "live", _bad_node(t.nodes[1], output_key=b"k" * 40)),
    "record not a node": lambda w, t: w.record_node("live", {"node_id": 2}),
    "duplicate close": lambda w, t: w.close_execution("done", t, status="completed"),
    "close foreign tree": lambda w, t: w.close_execution("live", t, status="completed"),
    "close status open": lambda w, t: w.close_execution("other", TrajectoryTree("other"), status="open"),
    "unknown table": lambda w, t: w.append("nope", [{}]),
    "missing column": lambda w, t: w.append("roles", [{"cell": 1, "role": "TRAIN", "t_start": 0.0}]),
    "extra column": lambda w, t: w.append("events", [{"t": 1.0, "kind": "k", "detail": "", "x": 1}]),
    "str in int column": lambda w, t: w.append("steps", [{"step": "1", "t": 1.0, "name": "a", "value": 1.0}]),
    "bool in int column": lambda w, t: w.append("steps", [{"step": True, "t": 1.0, "name": "a", "value": 1.0}]),
    "int in bool column": lambda w, t: w.append("rewards", [dict(execution_id="e", group_id="g", reward=1.0, valid=1, t=0.0)]),
    "bad row after good ones": lambda w, t: w.append("events", [{"t": 1.0, "kind": "k", "detail": ""}, {"t": "x", "kind": "k", "detail": ""}]),
    "rows not a list": lambda w, t: w.append("events", {"t": 1.0, "kind": "k", "detail": ""}),
}  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrajectoryTree]:
    path = tmp_path_factory.mktemp("bad") / "base.h5"
    done, live = make_tree(1, "done", 6), make_tree(2, "live", 5)
    with TraceWriter(path, run_meta={"config": "k: v\n"}) as w:
        w.open_execution("done", {"task": "t"})
        w.close_execution("done", done, status="completed")
        w.open_execution("live")
        w.record_node("live", live.nodes[0])
        w.append("events", [{"t": 1.0, "kind": "start", "detail": "{}"}])
    return path, done


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_is_refused_and_nothing_recorded_is_lost(
    recorded: tuple[Path, TrajectoryTree], tmp_path: Path, name: str
) -> None:
    src, done = recorded
    path = tmp_path / "run.h5"
    w = TraceWriter(path, run_meta={"config": "k: v\n"})
    w.open_execution("done", {"task": "t"})
    w.close_execution("done", done, status="completed")
    w.open_execution("live")
    live = make_tree(2, "live", 5)
    w.record_node("live", live.nodes[0])
    w.append("events", [{"t": 1.0, "kind": "start", "detail": "{}"}])
    try:
        before = _snapshot(path)
        assert before == _snapshot(src)
        with pytest.raises(TraceInputError) as err:
            BAD_CALLS[name](w, done)
        assert isinstance(err.value, StoreError | GyreError) and isinstance(err.value, ValueError)
        assert _snapshot(path) == before
        # the writer keeps working after a refusal
        w.record_node("live", live.nodes[1])
        w.close_execution("live", live, status="completed")
    finally:
        w.close()
    with TraceReader(path) as r:
        assert r.tree("live") == live and r.tree("done") == done


def test_error_messages_name_the_problem(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "m.h5", run_meta={}) as w:
        with pytest.raises(TraceInputError, match=r"declared: \['assessments'"):
            w.append("nope", [])
        with pytest.raises(TraceInputError, match=r"missing columns \['t_end'\]"):
            w.append("roles", [{"cell": 1, "role": "TRAIN", "t_start": 0.0}])
        with pytest.raises(TraceInputError, match="duplicate close"):
            w.close_execution("a", TrajectoryTree("a"), status="ok")
            w.close_execution("a", TrajectoryTree("a"), status="ok")
        with pytest.raises(TraceInputError, match="open_execution first"):
            w.record_node("b", make_tree(0, "b", 1).nodes[0])
    with pytest.raises(StoreError, match="trace writer is closed"):
        w.append("events", [])


def test_existing_file_and_unknown_format_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "v.h5"
    TraceWriter(path, run_meta={}).close()
    with pytest.raises(StoreError, match="already exists"):
        TraceWriter(path, run_meta={})
    TraceWriter(path, run_meta={"n": 2}, config=TraceWriter.Config(overwrite=True)).close()
    with TraceReader(path) as r:
        assert r.format_version == "1.2" and r.run_meta == {"n": 2}
    with h5py.File(path, "r") as f:  # provenance codes are named in the file itself
        names = h5py.check_enum_dtype(f["tokens/provenance"].dtype)
    assert names == {p.name.lower(): int(p) for p in Provenance}
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = "2.0"
    with pytest.raises(StoreError, match=r"format_version 2\.0 is not supported"):
        TraceReader(path)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1]
    with pytest.raises(StoreError, match="not a Gyre trace file"):
        TraceReader(tmp_path / "other.h5")
    with pytest.raises(StoreError, match="no such trace file"):
        TraceReader(tmp_path / "missing.h5")


def test_open_and_unclosed_executions_after_clean_close(tmp_path: Path) -> None:
    path = tmp_path / "o.h5"
    t = make_tree(3, "unfinished", 4)
    with TraceWriter(path, run_meta={}) as w:
        w.open_execution("unfinished", {"task": "x"})
        for n in t.nodes[:2]:
            w.record_node("unfinished", n)
        w.open_execution("empty")
    with TraceReader(path) as r:
        infos = {i.execution_id: i for i in r.executions()}
        assert infos["unfinished"].status == "open" and infos["unfinished"].num_nodes == 2
        assert infos["empty"].num_nodes == 0 and infos["unfinished"].meta == {"task": "x"}
        with pytest.raises(StoreError, match="is open"):
            r.tree("unfinished")
        with pytest.raises(StoreError, match="no execution"):
            r.tree("never")
        part = r.recover()["unfinished"]
        assert (
            len(part) == 2 and part.nodes[1].output_ids.tolist() == t.nodes[1].output_ids.tolist()
        )


def test_close_rewrites_journaled_nodes_that_changed(tmp_path: Path) -> None:
    """The closed tree is authoritative even if a journaled node differs from it."""
    path = tmp_path / "j.h5"
    t = make_tree(4, "e", 3)
    other = make_tree(5, "e", 3)
    with TraceWriter(path, run_meta={}) as w:
        w.open_execution("e", {"a": 1})
        w.record_node("e", other.nodes[0])
        w.close_execution("e", t, status="completed", meta={"b": 2})
    with TraceReader(path) as r:
        assert r.tree("e") == t
        assert r.executions()[0].meta == {"a": 1, "b": 2}


def test_store_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_chunk: 0"):
        TraceWriter.Config(token_chunk=0)
    with pytest.raises(StoreError, match="cannot create trace file"):
        TraceWriter(tmp_path / "no" / "such" / "dir.h5", run_meta={})
    with pytest.raises(TraceInputError, match="run_meta: not JSON-serializable"):
        TraceWriter(tmp_path / "m.h5", run_meta={"x": {1, 2}})
    assert not (tmp_path / "m.h5").exists()
