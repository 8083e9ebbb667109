"""HDF5 trace store: exact round trips, crash survival, live SWMR readers, refusal of bad input."""

from __future__ import annotations

import dataclasses
import json
import logging
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
from gyre.trajectory.schema import NODE_DTYPE, Table
from gyre.trajectory.store import TraceInputError, TraceReader, TraceWriter, recover
from gyre.trajectory.tree import Node, Provenance, TrajectoryTree

CHILD = str(Path(__file__).with_name("trace_child.py"))


def unique_ids(ts: list[TrajectoryTree]) -> bool:
    return len({t.execution_id for t in ts}) == len(ts)


ROUTED_TREES = st.lists(st.booleans().flatmap(lambda routing: trees(max_nodes=8, routing=routing)),
                        max_size=4).filter(unique_ids)  # fmt: skip
"""Up to 4 random trees, some whose nodes carry routed experts (some nodes of a tree, not all)."""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ROUTED_TREES,
    st.lists(st.integers(0, 9), min_size=4, max_size=4),
    st.dictionaries(TEXT, TEXT, max_size=3),
)
def test_round_trip_is_exact(ts: list[TrajectoryTree], journal: list[int], meta: dict) -> None:
    """Random trees (unicode ids/roles, empty inputs/outputs, routed experts on some nodes)
    read back bit for bit, journaled or not."""
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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ROUTED_TREES, st.lists(st.integers(0, 8), min_size=4, max_size=4))
def test_a_journal_recovers_exactly_what_was_recorded(
    ts: list[TrajectoryTree], journaled: list[int]
) -> None:
    """Executions never closed come back from the journal: the recorded prefix of each tree,
    bit for bit (routed experts included), and a tree closed after its journal reuses it."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.h5"
        w = TraceWriter(path, run_meta={})
        for t, k in zip(ts, journaled):
            w.open_execution(t.execution_id)
            for node in t.nodes[:k]:
                w.record_node(t.execution_id, node)
        with TraceReader(path) as r:  # read while the writer holds the file (SWMR)
            for t, k in zip(ts, journaled):
                assert r.recover()[t.execution_id] == _prefix_tree(t, k)
        for t in ts[::2]:
            w.close_execution(t.execution_id, t, status="completed")
        w.close()
        with TraceReader(path) as r:
            for t in ts[::2]:
                assert r.tree(t.execution_id).diff(t) == []
            assert set(r.recover()) == {t.execution_id for t in ts[1::2]}


def _prefix_tree(t: TrajectoryTree, k: int) -> TrajectoryTree:
    prefix = TrajectoryTree(t.execution_id)
    for node in t.nodes[:k]:
        prefix.append(node)
    return prefix


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


NODE_DTYPE_1_2 = np.dtype([(n, NODE_DTYPE.fields[n][0]) for n in NODE_DTYPE.names
                           if not n.startswith("routing_")])  # fmt: skip
"""The node row of formats 1.0-1.2, before routed experts: the fields of gyre/trajectory/
schema.py at 1.2, in order (execution ... output_key_len)."""


def _as_format_1_2(path: Path) -> None:
    """Rewrite a trace as format 1.2 stored it: node rows without the routing fields and no
    `tokens/routed_experts` (the datasets' other rows and contents stay as written)."""
    with h5py.File(path, "r+") as f:
        assert NODE_DTYPE_1_2.names[-1] == "output_key_len" and len(NODE_DTYPE_1_2) == 18
        for name in ("trees/nodes", "journal/nodes"):
            rows = f[name][:]
            del f[name]
            f.create_dataset(name, data=rows[list(NODE_DTYPE_1_2.names)].astype(NODE_DTYPE_1_2),
                             maxshape=(None,), chunks=(64,))  # fmt: skip
        del f["tokens/routed_experts"]
        f.attrs["format_version"] = "1.2"


def _without_routing(t: TrajectoryTree, k: int | None = None) -> TrajectoryTree:
    """The first k nodes of `t` (all by default) as a trace without routing reads them."""
    out = TrajectoryTree(t.execution_id)
    for node in t.nodes[:k]:
        out.append(dataclasses.replace(node, routed_experts=None))
    return out


def test_a_1_2_trace_reads_no_routing_and_is_continued_in_its_own_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.h5"
    closed, journaled = make_tree(1, "closed", 4), make_tree(2, "journaled", 4)
    with TraceWriter(path, run_meta={}) as w:  # no routing: what a 1.2 writer wrote
        w.close_execution("closed", closed, status="completed")
        w.open_execution("journaled")
        for node in journaled.nodes[:2]:
            w.record_node("journaled", node)
    _as_format_1_2(path)
    with TraceReader(path) as r:
        assert r.format_version == "1.2" and not r.stores_routing
        assert r.tree("closed") == closed
        assert r.recover() == {"journaled": _without_routing(journaled, 2)}
    routed = make_tree(3, "routed", 5, routing=(4, 2))
    assert sum(n.routed_experts is not None for n in routed.nodes) >= 2
    w = TraceWriter.reopen(path)  # a resumed run keeps appending, routing left out
    assert not w.stores_routing and w.open_executions == ["journaled"]
    w.close_execution("journaled", journaled, status="completed")
    w.open_execution("routed")
    with caplog.at_level(logging.WARNING, logger="gyre.trajectory.store"):
        for node in routed.nodes[:3]:
            w.record_node("routed", node)
        w.close_execution("routed", routed, status="completed")
    assert [m for m in caplog.messages if "stores no routed experts" in m] != []
    w.close()
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == "1.2" and "routed_experts" not in f["tokens"]
        assert f["trees/nodes"].dtype == NODE_DTYPE_1_2 == f["journal/nodes"].dtype
    with TraceReader(path) as r:
        assert r.tree("closed") == closed and r.tree("journaled") == journaled
        assert r.tree("routed") == _without_routing(routed)
        assert r.recover() == {}


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


def test_a_writer_killed_while_it_opens_the_trace_leaves_it_readable(tmp_path: Path) -> None:
    """A job killed while its writer creates or reopens the trace (a start-up kill) leaves
    nothing a reader cannot open: no trace at all, or the last one with every closed
    execution, which the next writer continues."""
    path = tmp_path / "run.h5"
    died = subprocess.run([sys.executable, CHILD, "die-creating", str(path)], timeout=60)
    assert died.returncode == -signal.SIGKILL
    with pytest.raises(StoreError, match="no such trace file"):
        TraceReader(path)
    w = TraceWriter(path, run_meta={})  # not "already exists": the next job starts afresh
    trees = [expected_tree(i) for i in range(3)]
    for t in trees:
        w.open_execution(t.execution_id, {})
        w.record_node(t.execution_id, t.nodes[0])
    for t in trees[:2]:
        w.close_execution(t.execution_id, t, status="completed")
    w.close()  # one left open: a resumed run's reopen finds it journaled

    for _ in range(2):  # killed while repairing, then again on a trace it had reopened
        died = subprocess.run([sys.executable, CHILD, "die-reopening", str(path)], timeout=60)
        assert died.returncode == -signal.SIGKILL
        with TraceReader(path) as r:
            assert {i.execution_id for i in r.executions() if i.closed} == {
                t.execution_id for t in trees[:2]
            }
            for t in trees[:2]:
                assert r.tree(t.execution_id).diff(t) == []
    w2 = TraceWriter.reopen(path)
    assert set(w2.open_executions) == {trees[2].execution_id}
    w2.close()


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


def test_rows_whose_routing_a_crash_lost_are_cut(tmp_path: Path) -> None:
    """A node row is complete only with all its routed experts in the file: a reader stops a
    journal before the first row that lacks them and refuses such a closed tree; `reopen`
    cuts those rows (and the execution row that references them) and the run goes on."""
    from gyre.trajectory import schema as S

    path = tmp_path / "torn.h5"
    keep, live, torn = (make_tree(seed, eid, 6, routing=(4, 2))
                        for seed, eid in ((5, "keep"), (6, "live"), (7, "torn")))  # fmt: skip
    with TraceWriter(path, run_meta={}) as w:
        w.close_execution("keep", keep, status="completed")
        w.open_execution("live")
        for node in live.nodes:
            w.record_node("live", node)
        w.close_execution("torn", torn, status="completed")
    routed = [i for i, n in enumerate(live.nodes) if n.routed_experts is not None and n.num_tokens]
    lost = routed[1]  # the crash lost the routing from inside live's node lost + 1 on
    first_torn = next(i for i, n in enumerate(torn.nodes) if n.routed_experts is not None)
    with h5py.File(path, "a", libver="latest") as f:
        f[S.ROUTED_EXPERTS].resize((int(f[S.JOURNAL_NODES]["routing_start"][lost]) + 1,))
    with TraceReader(path) as r:
        assert r.tree("keep") == keep and r.recover() == {"live": _prefix_tree(live, lost)}
        with pytest.raises(StoreError, match="'torn' is corrupt"):
            r.tree("torn")
    w = TraceWriter.reopen(path)
    assert w.repaired == {S.NODES: len(torn) - first_torn, S.JOURNAL_NODES: len(live) - lost,
                          S.EXECUTIONS: 1}  # fmt: skip
    assert w.open_executions == ["live"]
    w.close_execution("live", live, status="completed")  # the resumed run closes it
    w.close_execution("torn", torn, status="completed")  # and may write it again
    w.close()
    with TraceReader(path) as r:
        assert [r.tree(e) for e in ("keep", "live", "torn")] == [keep, live, torn]


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


def _routed(base: Node, dtype: type = np.int16, extra: int = 0, fill: int = 3) -> Node:
    """`base` with routed experts [its tokens + extra, 2, 2] of `dtype`, all `fill`."""
    return _bad_node(base, routed_experts=np.full((base.num_tokens + extra, 2, 2), fill, dtype))


def _tree_of(execution_id: str, node: Node) -> TrajectoryTree:
    tree = TrajectoryTree(execution_id)
    tree.append(node)  # unchecked, as a tree another process recorded
    return tree


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
    "record routing int32": lambda w, t: w.record_node("live", _routed(t.nodes[1], np.int32)),
    "record routing too long": lambda w, t: w.record_node("live", _routed(t.nodes[1], extra=1)),
    "record routing 2-D": lambda w, t: w.record_node(
        "live", _bad_node(t.nodes[1], routed_experts=np.zeros((t.nodes[1].num_tokens, 4), np.int16))),
    "record routing below -1": lambda w, t: w.record_node("live", _routed(t.nodes[1], fill=-2)),
    "record routing a list": lambda w, t: w.record_node(
        "live", _bad_node(t.nodes[1], routed_experts=[[[0]]] * t.nodes[1].num_tokens)),
    "close malformed routing": lambda w, t: w.close_execution(
        "other", _tree_of("other", _routed(t.nodes[0], extra=1)), status="completed"),
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
        w.open_execution("c")
        node = make_tree(0, "c", 1).nodes[0]
        n = node.num_tokens
        with pytest.raises(TraceInputError, match=rf"node: routed_experts must be None or an "
                           rf"int16 array \[{n}, layers, top_k\].*got int64 \[{n + 1}, 2, 2\]"):  # fmt: skip
            w.record_node("c", _routed(node, np.int64, extra=1))
        with pytest.raises(
            TraceInputError, match=r"routed_experts holds -7; expert indices are -1"
        ):
            w.record_node("c", _routed(node, fill=-7))
    with pytest.raises(StoreError, match="trace writer is closed"):
        w.append("events", [])


def test_existing_file_and_unknown_format_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "v.h5"
    TraceWriter(path, run_meta={}).close()
    with pytest.raises(StoreError, match="already exists"):
        TraceWriter(path, run_meta={})
    TraceWriter(path, run_meta={"n": 2}, config=TraceWriter.Config(overwrite=True)).close()
    with TraceReader(path) as r:
        assert r.format_version == "1.3" and r.run_meta == {"n": 2}
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


def test_close_keeps_the_routing_of_the_closed_tree(tmp_path: Path) -> None:
    """A journaled node whose tokens equal the closed tree's but whose routed experts do not
    (none journaled, or other ones) is written again: the trace holds the tree's routing."""
    path = tmp_path / "r.h5"
    routed = make_tree(8, "e", 3, routing=(2, 2))
    plain = _without_routing(routed)
    other = TrajectoryTree("e")
    for node in routed.nodes:
        if node.routed_experts is not None:
            node = dataclasses.replace(node, routed_experts=node.routed_experts[:, ::-1].copy())
        other.append(node)
    assert other != routed and any(n.routed_experts is not None for n in routed.nodes)
    with TraceWriter(path, run_meta={}) as w:
        for eid, journaled, closed in (("e", plain, routed), ("f", other, routed),
                                       ("g", routed, plain)):  # fmt: skip
            w.open_execution(eid)
            for node in journaled.nodes:
                w.record_node(eid, node)
            w.close_execution(eid, _renamed(closed, eid), status="completed")
    with TraceReader(path) as r:
        assert r.tree("e") == routed and r.tree("f") == _renamed(routed, "f")
        assert r.tree("g") == _renamed(plain, "g")


def _renamed(t: TrajectoryTree, execution_id: str) -> TrajectoryTree:
    out = TrajectoryTree(execution_id)
    for node in t.nodes:
        out.append(node)
    return out


def test_store_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_chunk: 0"):
        TraceWriter.Config(token_chunk=0)
    with pytest.raises(StoreError, match="cannot create trace file"):
        TraceWriter(tmp_path / "no" / "such" / "dir.h5", run_meta={})
    with pytest.raises(TraceInputError, match="run_meta: not JSON-serializable"):
        TraceWriter(tmp_path / "m.h5", run_meta={"x": {1, 2}})
    assert not (tmp_path / "m.h5").exists()
