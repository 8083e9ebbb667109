"""`gyre trace export`: flat Parquet / CSV tables with real strings, read back with pandas
(and, for a real run's export with decoded text, with DuckDB's SQL).

A synthetic trace (a branchy closed tree, an open execution known only from the journal,
Unicode strings, a table the run declared) checks every column against the trees it came
from, each against a slow, obvious reference (`TrajectoryTree.context_ids`, `path`,
`children`, `np.bincount`). One real `gyre run` checks what an analyst relies on: every
documented column present, strings are strings, the docs' pandas example runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from trajectory_strategies import make_tree
from worlds import ROOT

from gyre.errors import StoreError
from gyre.models import tiny_tokenizer
from gyre.trajectory.export import (
    EXECUTION_COLUMNS,
    NODE_COLUMNS,
    PROVENANCE_NAMES,
    TEXT_COLUMNS,
    TOKEN_COLUMNS,
    export_trace,
)
from gyre.trajectory.reader import TraceReader
from gyre.trajectory.schema import Table
from gyre.trajectory.store import TraceWriter
from gyre.trajectory.tree import Provenance, TrajectoryTree

DOC = ROOT / "docs" / "trace-format.md"
OPEN_ID = "g0-é1"  # a non-ASCII execution id: strings must come back as the same str


def doc_columns(table: str) -> list[tuple[str, str]]:
    """(column, type) rows of the docs' table under **`table`**."""
    text = DOC.read_text()
    start = text.index(f"**`{table}`**")
    block = text[start:].split("\n\n")[1]
    return re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", block, re.M)


def doc_pandas_example() -> str:
    section = DOC.read_text().split("## Export for analysis")[1]
    return section.split("```python\n")[1].split("```")[0]


def write_trace(path: Path) -> dict[str, TrajectoryTree]:
    closed, partial = make_tree(3, "g0-e0", 9), make_tree(9, OPEN_ID, 3, routing=(4, 2))
    groups = [{"group_id": "g0", "task_id": "tâsk@7", "execution_id": e, "policy_version": 2,
               "t_dispatch": 10.0} for e in ("g0-e0", OPEN_ID)]  # fmt: skip
    notes = Table("notes", (("who", "str"), ("n", "int")))
    path.parent.mkdir(parents=True, exist_ok=True)
    with TraceWriter(path, run_meta={"config": "name: t\n"}, tables=[notes]) as w:
        w.append("groups", groups)
        w.open_execution("g0-e0", {"engine": "e1", "group": "g0", "task": "tâsk"})
        w.close_execution("g0-e0", closed, status="timed_out",
                          meta={"verdict": "scored", "reward": 0.5, "t_ended": 12.5})  # fmt: skip
        w.append("rewards", [{"execution_id": "g0-e0", "group_id": "g0", "reward": 0.5,
                              "valid": True, "t": 11.0}])  # fmt: skip
        w.open_execution(OPEN_ID, {"group": "g0", "task": "tâsk"})
        for node in partial.nodes:
            w.record_node(OPEN_ID, node)
        w.append("notes", [{"who": "ünï\ncode", "n": 3}])
        w.append("events", [{"t": 1.0, "kind": "switch", "detail": '{"cell": 0, "to": "train"}'},
                            {"t": 2.0, "kind": "admit", "detail": '{"group": "g0", "batch": 3}'},
                            {"t": 2.0, "kind": "set_aside",
                             "detail": '{"group": "g0", "batch": 3}'}])  # fmt: skip
    return {"g0-e0": closed, OPEN_ID: partial}


@pytest.fixture
def exported(tmp_path: Path) -> tuple[dict[str, TrajectoryTree], dict[str, Path]]:
    trees = write_trace(tmp_path / "run" / "trace.h5")
    files = export_trace(tmp_path / "run", tmp_path / "out", tokens=True)  # a run directory
    return trees, files


def test_documented_columns_are_the_exported_ones(exported: tuple) -> None:
    _, files = exported
    for name, columns in (("executions", EXECUTION_COLUMNS), ("nodes", NODE_COLUMNS),
                          ("tokens", TOKEN_COLUMNS)):  # fmt: skip
        documented = doc_columns(name)
        assert [c for c, _ in documented] == [c for c, _, _ in columns], name
        assert list(pd.read_parquet(files[name]).columns) == [c for c, _ in documented]
    for name in ("assessments", "rewards", "groups", "roles", "dispatch", "steps", "events"):
        assert files[name].exists()


def test_nodes_match_the_trees(exported: tuple) -> None:
    trees, files = exported
    nodes = pd.read_parquet(files["nodes"])
    assert len(nodes) == sum(len(t) for t in trees.values())
    for eid, tree in trees.items():
        rows = nodes[nodes.execution_id == eid].reset_index(drop=True)
        leaves = set(tree.leaves())
        for node, row in zip(tree.nodes, rows.itertuples()):
            k = node.node_id
            assert (row.node_id, row.parent_id, row.role, row.engine_id, row.policy_version) == (
                k, node.parent_id, node.role, node.engine_id, node.policy_version)  # fmt: skip
            assert isinstance(row.role, str) and isinstance(row.execution_id, str)
            assert row.depth == len(tree.path(k)) and row.children == len(tree.children(k))
            assert row.leaf == (k in leaves) and row.closed == (eid == "g0-e0")
            assert row.context_tokens == len(tree.context_ids(k))
            assert (row.input_tokens, row.output_tokens) == (len(node.input_ids),
                                                             len(node.output_ids))  # fmt: skip
            routed = node.routed_experts
            assert (row.routing_layers, row.routing_top_k) == ((0, 0) if routed is None
                                                               else routed.shape[1:])  # fmt: skip
            counts = np.bincount(node.input_provenance, minlength=len(Provenance))
            for p in Provenance:
                if p != Provenance.POLICY:
                    assert getattr(row, f"input_{PROVENANCE_NAMES[p]}") == counts[p]


def test_the_routed_trees_are_exported(exported: tuple) -> None:
    """The journaled tree of the export fixture carries routed experts (some nodes, not all)."""
    trees, _ = exported
    assert {n.routed_experts is None for n in trees[OPEN_ID].nodes} == {True, False}


def test_tokens_rebuild_every_node(exported: tuple) -> None:
    trees, files = exported
    tokens = pd.read_parquet(files["tokens"])
    for eid, tree in trees.items():
        for node in tree.nodes:
            rows = tokens[(tokens.execution_id == eid) & (tokens.node_id == node.node_id)]
            ids = np.concatenate([node.input_ids, node.output_ids])
            assert np.array_equal(rows.token_id.to_numpy(), ids)
            assert list(rows.position) == list(range(len(ids)))
            prov = [PROVENANCE_NAMES[c] for c in node.input_provenance]
            assert list(rows.provenance.astype(str)) == prov + ["policy"] * len(node.output_ids)
            out = rows[rows.output]
            assert np.array_equal(out.logprob.to_numpy(np.float32), node.output_logprobs)
            assert rows[~rows.output].logprob.isna().all()


def test_executions_join_tables_meta_and_tree_stats(exported: tuple) -> None:
    trees, files = exported
    ex = pd.read_parquet(files["executions"]).set_index("execution_id")
    done, live = ex.loc["g0-e0"], ex.loc[OPEN_ID]
    stats = trees["g0-e0"].stats()
    assert (done.status, done.verdict, done.reward, done.valid, done.closed) == (
        "timed_out", "scored", 0.5, True, True)  # fmt: skip
    assert (done.group_id, done.task_id, done.engine, done.dispatch_policy_version) == (
        "g0", "tâsk@7", "e1", 2)  # fmt: skip
    assert (done.task, done.instance, done.batch, done.set_aside) == ("tâsk", "7", 3, True)
    assert (done.unique_tokens, done.flat_tokens, done.flat_policy_tokens, done.num_leaves) == (
        stats.unique_tokens, stats.flat_tokens, stats.flat_policy_tokens, stats.num_leaves)  # fmt: skip
    versions = [n.policy_version for n in trees["g0-e0"].nodes]
    assert (done.min_policy_version, done.max_policy_version) == (min(versions), max(versions))
    assert done.depth == max(len(trees["g0-e0"].path(k)) for k in trees["g0-e0"].leaves())
    assert json.loads(done.meta)["reward"] == 0.5
    assert (live.status, live.closed, live.task_id, live.num_nodes) == ("open", False, "tâsk@7", 3)
    assert np.isnan(live.reward) and pd.isna(live.valid) and np.isnan(live.t_close)
    assert done.t_ended == 12.5 and np.isnan(live.t_ended)  # the harness's end, where recorded


def test_store_tables_and_run_json(exported: tuple, tmp_path: Path) -> None:
    _, files = exported
    notes = pd.read_parquet(files["notes"])  # a table the run declared
    assert notes.to_dict("records") == [{"who": "ünï\ncode", "n": 3}]
    events = pd.read_parquet(files["events"])
    assert json.loads(events.detail[0]) == {"cell": 0, "to": "train"}
    meta = json.loads((tmp_path / "out" / "run.json").read_text())
    assert meta["run_meta"] == {"config": "name: t\n"} and meta["writer_closed"] is True
    assert meta["rows"]["nodes"] == 12 and meta["rows"]["tokens"] == len(
        pd.read_parquet(files["tokens"]))  # fmt: skip


def test_csv_holds_the_same_tables(exported: tuple, tmp_path: Path) -> None:
    _, parquet = exported
    csv = export_trace(tmp_path / "run" / "trace.h5", tmp_path / "csv", fmt="csv", tokens=True)
    for name in ("executions", "nodes", "tokens", "notes", "groups"):
        a = pd.read_parquet(parquet[name])
        # pyarrow's reader keeps "" (quoted) apart from a missing value (unquoted)
        a = a.astype({c: str for c in a.columns if isinstance(a[c].dtype, pd.CategoricalDtype)})
        # and reads a string column of digits (an instance seed) as strings, as exported
        strings = {c: pa.string() for c in a.columns if pd.api.types.is_string_dtype(a[c])}
        options = pa_csv.ConvertOptions(quoted_strings_can_be_null=False, column_types=strings)
        b = pa_csv.read_csv(csv[name], convert_options=options).to_pandas()
        pd.testing.assert_frame_equal(a, b, check_dtype=False)


def test_bad_arguments_are_store_errors(tmp_path: Path) -> None:
    write_trace(tmp_path / "trace.h5")
    with pytest.raises(StoreError, match="format: 'xlsx'; allowed: parquet, csv"):
        export_trace(tmp_path, tmp_path / "out", fmt="xlsx")
    with pytest.raises(StoreError, match="no such trace file"):
        export_trace(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(StoreError, match="--text needs the run's model"):
        export_trace(tmp_path, tmp_path / "out", text=True)  # its run_meta names no model


@pytest.mark.slow
@pytest.mark.mpi
def test_export_of_a_real_run_reads_back_with_pandas(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "gyre", "trace", "export", str(run_dir),
                           "--out", str(out), "--tokens", "--text"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with TraceReader(run_dir / "trace.h5") as reader:
        infos = reader.executions()
        sizes = reader.table_sizes()
    ex = pd.read_parquet(out / "executions.parquet")
    nodes = pd.read_parquet(out / "nodes.parquet")
    assert list(ex.columns) == [c for c, _ in doc_columns("executions")]
    assert list(nodes.columns) == [c for c, _ in doc_columns("nodes") + doc_columns("--text")]
    assert [c for c, _ in doc_columns("--text")] == [c for c, _, _ in TEXT_COLUMNS]
    assert list(ex.execution_id) == [i.execution_id for i in infos]
    assert len(nodes) == sum(i.num_nodes for i in infos) > 0
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert len(tokens) == ex.unique_tokens.sum()
    tok = tiny_tokenizer()  # the e2e run's model: --text decodes what the tokens table holds
    by_node = {k: g for k, g in tokens.groupby(["execution_id", "node_id"], observed=True)}
    for row in nodes.itertuples():
        rows = by_node.get((row.execution_id, row.node_id))
        ids = [] if rows is None else rows.token_id.tolist()
        outs = [] if rows is None else rows.token_id[rows.output].tolist()
        assert row.output_text == tok.decode(outs, skip_special_tokens=False)
        assert row.input_text == tok.decode(ids[: len(ids) - len(outs)], skip_special_tokens=False)
    assert nodes.output_text.str.contains("<tool_call>").any()
    for name, rows in sizes.items():
        assert len(pd.read_parquet(out / f"{name}.parquet")) == rows, name
    for column in ("execution_id", "group_id", "task_id", "status", "verdict", "engine"):
        assert all(isinstance(v, str) and v for v in ex[column]), column
    assert all(isinstance(v, str) and v for v in nodes.role)
    steps = pd.read_parquet(out / "steps.parquet").pivot(index="step", columns="name",
                                                         values="value")  # fmt: skip
    assert {"loss", "reward_mean", "staleness_mean"} <= set(steps.columns)

    example = subprocess.run([sys.executable, "-c", doc_pandas_example()], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert example.returncode == 0, example.stderr
    for task in set(ex.task_id):
        assert task in example.stdout

    # the same files in SQL (DuckDB reads Parquet directly): per task, nodes and output
    # characters of the decoded text, joined through the executions table
    import duckdb

    sql = duckdb.sql(f"""
        SELECT e.task_id, count(*) AS nodes, sum(length(n.output_text)) AS chars
        FROM '{out / "nodes.parquet"}' n JOIN '{out / "executions.parquet"}' e
          USING (execution_id)
        GROUP BY e.task_id ORDER BY e.task_id""").fetchall()  # fmt: skip
    joined = nodes.merge(ex[["execution_id", "task_id"]], on="execution_id")
    by_task = joined.groupby("task_id").agg(n=("node_id", "size"),
                                            chars=("output_text", lambda t: t.str.len().sum()))  # fmt: skip
    assert sql == [(t, int(r.n), int(r.chars)) for t, r in by_task.sort_index().iterrows()]
