"""Flat tables of a run's trace for analysts: `gyre trace export` to Parquet or CSV (pyarrow).

The HDF5 store keeps strings as string-pool ids and nodes as rows of per-execution trees,
so plain h5py or pandas users see integers and offsets. This module reads a trace through
`TraceReader` (live, finished or crashed) and turns it into flat tables with real strings:

* `executions` — one row per execution: group, task, status, verdict, reward, validity,
  a repository task's per-test outcomes, timings, policy versions, engines, token counts
  (`EXECUTION_COLUMNS`);
* `nodes` — one row per model call: parent, depth, role, token counts by provenance,
  policy version, engine, finish reason, attempts, timings, the shape of its routed experts
  (`NODE_COLUMNS`; the experts themselves stay in the trace: `Node.routed_experts`);
* every declared table as stored (`assessments`, `rewards`, `groups`, `roles`, `dispatch`,
  `steps`, `events`, and any a run added);
* optionally `tokens` — one row per stored token: ids, provenance, behaviour log-probs
  (`TOKEN_COLUMNS`), written in row groups so memory stays bounded.

Open executions (a live run, or a writer that died) are exported from their journaled
nodes with `closed` false. Columns are documented in docs/trace-format.md. The output
directory may not be, hold or lie inside the trace (`gyre.fsafe`: `--out RUN_DIR` is
refused, `--out RUN_DIR/export` is fine); a write that fails (read-only, full disk) is one
error naming the path.

    export_trace("runs/x", "out", fmt="parquet", tokens=True)   # {table: path}
    tables = build_tables(reader)                                 # {table: pyarrow.Table}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from gyre import fsafe
from gyre.errors import StoreError
from gyre.trajectory.reader import ExecutionInfo, TraceReader, trace_path
from gyre.trajectory.tree import Node, Provenance, TrajectoryTree

Format = Literal["parquet", "csv"]
FORMATS: tuple[str, ...] = ("parquet", "csv")
PROVENANCE_NAMES = [p.name.lower() for p in Provenance]  # code -> name ("policy", "tool", ...)
INPUT_PROVENANCES = [p for p in Provenance if p != Provenance.POLICY]
ROW_GROUP = 1 << 20  # rows per written Parquet row group / CSV chunk

# (column, arrow type, meaning); docs/trace-format.md lists the same columns
EXECUTION_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("execution_id", pa.string(), "execution id"),
    ("group_id", pa.string(), "group (groups table, else the execution's meta)"),
    ("task_id", pa.string(), "task instance (groups table, else the execution's meta)"),
    ("task", pa.string(), "task name: task_id before its '@'"),
    ("instance", pa.string(), "instance of the task: task_id after its '@' ('' if none)"),
    ("batch", pa.int64(), "training batch its group was admitted to (null: never admitted)"),
    ("set_aside", pa.bool_(), "its group was admitted but set aside (too few usable outcomes)"),
    ("status", pa.string(), "close status (completed, timed_out, failed, ...) or open"),
    ("verdict", pa.string(), "evaluator verdict from the meta (scored, excluded, ...)"),
    ("reward", pa.float64(), "designated reward (rewards table; NaN if none)"),
    ("valid", pa.bool_(), "reward validity (rewards table; null if none)"),
    ("error", pa.string(), "evaluator / runtime error from the meta"),
    ("tests", pa.string(), "per-test outcomes (JSON list of {test, kind, outcome}; '[]': none)"),
    ("closed", pa.bool_(), "false: never closed, exported from the journal"),
    ("t_dispatch", pa.float64(), "dispatch time (unix s; NaN if not in groups)"),
    ("t_open", pa.float64(), "open time (unix s)"),
    ("t_ended", pa.float64(), "its harness's end (unix s; NaN: not recorded)"),
    ("t_close", pa.float64(), "close time (unix s; NaN while open)"),
    ("seconds", pa.float64(), "t_close - t_open"),
    ("dispatch_policy_version", pa.int64(), "policy version at dispatch (null if unknown)"),
    ("min_policy_version", pa.int64(), "lowest policy version of its calls (null: none)"),
    ("max_policy_version", pa.int64(), "highest policy version of its calls (null: none)"),
    ("engine", pa.string(), "engine it was launched on (meta)"),
    ("engines", pa.string(), "engines that served its calls, comma-separated"),
    ("num_nodes", pa.int64(), "model calls"),
    ("num_leaves", pa.int64(), "leaves (trajectories)"),
    ("depth", pa.int64(), "calls on the longest root-to-leaf path"),
    ("input_tokens", pa.int64(), "new input tokens stored over all calls"),
    ("output_tokens", pa.int64(), "sampled tokens over all calls"),
    ("unique_tokens", pa.int64(), "tokens stored (each once)"),
    ("flat_tokens", pa.int64(), "sum over leaves of the path length"),
    ("unique_policy_tokens", pa.int64(), "sampled tokens stored"),
    ("flat_policy_tokens", pa.int64(), "sum over leaves of the sampled tokens on the path"),
    ("attempts", pa.int64(), "engine attempts over all calls"),
    ("meta", pa.string(), "the execution's whole meta (JSON)"),
)

NODE_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("execution_id", pa.string(), "execution id"),
    ("node_id", pa.int32(), "1..n in creation order"),
    ("parent_id", pa.int32(), "0 = attached to the root"),
    ("depth", pa.int32(), "calls on the path from the root (1 for a root child)"),
    ("children", pa.int32(), "child calls"),
    ("leaf", pa.bool_(), "no children: ends a trajectory"),
    ("role", pa.string(), "main, subagent, compaction, ..."),
    ("policy_version", pa.int64(), "weight version that served the call"),
    ("engine_id", pa.string(), "engine that served the call"),
    ("finish_reason", pa.string(), "engine finish type"),
    ("attempts", pa.int32(), "engine attempts (> 1: rerouted)"),
    ("t_start", pa.float64(), "call start (unix s)"),
    ("t_end", pa.float64(), "call end (unix s)"),
    ("seconds", pa.float64(), "t_end - t_start"),
    ("context_tokens", pa.int64(), "prompt length the engine saw"),
    ("input_tokens", pa.int64(), "new input tokens after the parent's output"),
    ("output_tokens", pa.int64(), "sampled tokens (all POLICY provenance)"),
    *(
        (f"input_{PROVENANCE_NAMES[p]}", pa.int64(), f"new input tokens of provenance {p.name}")
        for p in INPUT_PROVENANCES
    ),
    ("routing_layers", pa.int32(), "MoE layers of its routed experts (0: none recorded)"),
    ("routing_top_k", pa.int32(), "experts per layer of its routed experts (0: none recorded)"),
    ("closed", pa.bool_(), "false: journaled node of an open execution"),
)

# `nodes` columns added by `--text` (the run's tokenizer decodes; special tokens kept)
TEXT_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("input_text", pa.string(), "the call's new input tokens, decoded"),
    ("output_text", pa.string(), "the call's sampled tokens, decoded"),
)

TOKEN_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("execution_id", pa.dictionary(pa.int32(), pa.string()), "execution id"),
    ("node_id", pa.int32(), "node that stores the token"),
    ("position", pa.int32(), "index among the node's stored tokens (inputs first)"),
    ("output", pa.bool_(), "sampled in this call (else new input)"),
    ("token_id", pa.int32(), "token id"),
    ("provenance", pa.dictionary(pa.int8(), pa.string()), "policy, system, user, tool, ..."),
    ("logprob", pa.float32(), "behaviour log-prob (null for input tokens)"),
)


def schema(columns: tuple[tuple[str, pa.DataType, str], ...]) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, typ, _ in columns])


# -- the tables -------------------------------------------------------------------------------


def executions(reader: TraceReader) -> Iterator[tuple[ExecutionInfo, TrajectoryTree]]:
    """Every execution with its tree: closed ones from the store, open ones from the journal."""
    infos = reader.executions()
    partial = reader.recover() if any(not i.closed for i in infos) else {}
    for info in infos:
        eid = info.execution_id
        yield info, reader.tree(eid) if info.closed else partial[eid]


Decode = Callable[[list[int]], str]  # token ids -> text (the run's tokenizer)


def node_columns(
    tree: TrajectoryTree, closed: bool, decode: Decode | None = None
) -> dict[str, Any]:
    """The `nodes` columns of one tree (provenance counts vectorized over its tokens), with
    `TEXT_COLUMNS` when `decode` is given."""
    nodes = tree.nodes
    n = len(nodes)
    parent = np.array([nd.parent_id for nd in nodes], np.int32)
    n_in = np.array([len(nd.input_ids) for nd in nodes], np.int64)
    n_out = np.array([len(nd.output_ids) for nd in nodes], np.int64)
    depth = np.zeros(n + 1, np.int32)
    for k in range(1, n + 1):  # parents precede children
        depth[k] = depth[parent[k - 1]] + 1
    before = np.array([tree.path_length(int(p)) for p in parent], np.int64)  # parent's path
    children = np.bincount(parent, minlength=n + 1)[1:].astype(np.int32)
    width = len(Provenance)
    prov = np.zeros((n, width), np.int64)
    if n_in.sum():
        codes = np.concatenate([nd.input_provenance for nd in nodes]).astype(np.int64)
        owner = np.repeat(np.arange(n), n_in)
        prov = np.bincount(owner * width + codes, minlength=n * width).reshape(n, width)
    t_start = np.array([nd.t_start for nd in nodes], np.float64)
    t_end = np.array([nd.t_end for nd in nodes], np.float64)
    cols = {
        "execution_id": [tree.execution_id] * n,
        "node_id": np.arange(1, n + 1, dtype=np.int32),
        "parent_id": parent,
        "depth": depth[1:],
        "children": children,
        "leaf": children == 0,
        "role": [nd.role for nd in nodes],
        "policy_version": np.array([nd.policy_version for nd in nodes], np.int64),
        "engine_id": [nd.engine_id for nd in nodes],
        "finish_reason": [nd.finish_reason for nd in nodes],
        "attempts": np.array([nd.attempts for nd in nodes], np.int32),
        "t_start": t_start,
        "t_end": t_end,
        "seconds": t_end - t_start,
        "context_tokens": before + n_in,
        "input_tokens": n_in,
        "output_tokens": n_out,
        **{f"input_{PROVENANCE_NAMES[p]}": prov[:, p] for p in INPUT_PROVENANCES},
        "routing_layers": np.array([_routing_dims(nd)[0] for nd in nodes], np.int32),
        "routing_top_k": np.array([_routing_dims(nd)[1] for nd in nodes], np.int32),
        "closed": np.full(n, closed),
    }
    if decode is not None:
        cols["input_text"] = [decode(nd.input_ids.tolist()) for nd in nodes]
        cols["output_text"] = [decode(nd.output_ids.tolist()) for nd in nodes]
    return cols


def _routing_dims(node: Node) -> tuple[int, int]:
    """(layers, top_k) of a node's routed experts; (0, 0) when it has none."""
    r = node.routed_experts
    return (0, 0) if r is None else (int(r.shape[1]), int(r.shape[2]))


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def _execution_row(
    info: ExecutionInfo, tree: TrajectoryTree, nodes: dict[str, Any], joins: dict[str, Any]
) -> dict[str, Any]:
    meta, eid = info.meta, info.execution_id
    group, reward = joins["groups"].get(eid, {}), joins["rewards"].get(eid, {})
    st = tree.stats()
    versions = nodes["policy_version"]
    t_close = math.nan if info.t_close is None else info.t_close
    task_id = group.get("task_id", str(meta.get("task", "")))
    group_id = group.get("group_id", str(meta.get("group", "")))
    task, _, instance = task_id.partition("@")
    admitted = joins["admitted"].get(group_id, {})
    return {
        "execution_id": eid,
        "group_id": group_id,
        "task_id": task_id,
        "task": task,
        "instance": instance,
        "batch": admitted.get("batch"),
        "set_aside": admitted.get("set_aside", False),
        "status": info.status,
        "verdict": str(meta.get("verdict", "")),
        "reward": reward.get("reward", math.nan),
        "valid": reward.get("valid"),
        "error": str(meta.get("error", "")),
        "tests": json.dumps(meta.get("tests", [])),
        "closed": info.closed,
        "t_dispatch": group.get("t_dispatch", math.nan),
        "t_open": info.t_open,
        "t_ended": _seconds(meta.get("t_ended")),
        "t_close": t_close,
        "seconds": t_close - info.t_open,
        "dispatch_policy_version": group.get("policy_version"),
        "min_policy_version": int(versions.min()) if len(versions) else None,
        "max_policy_version": int(versions.max()) if len(versions) else None,
        "engine": str(meta.get("engine", "")),
        "engines": ",".join(sorted(set(nodes["engine_id"]))),
        "num_nodes": st.num_nodes,
        "num_leaves": st.num_leaves,
        "depth": int(nodes["depth"].max()) if len(versions) else 0,
        "input_tokens": int(nodes["input_tokens"].sum()),
        "output_tokens": int(nodes["output_tokens"].sum()),
        "unique_tokens": st.unique_tokens,
        "flat_tokens": st.flat_tokens,
        "unique_policy_tokens": st.unique_policy_tokens,
        "flat_policy_tokens": st.flat_policy_tokens,
        "attempts": int(nodes["attempts"].sum()),
        "meta": json.dumps(meta, sort_keys=True),
    }


def _joins(reader: TraceReader) -> dict[str, dict[str, dict[str, Any]]]:
    """Per execution: its `groups` row and its last `rewards` row; per group: the batch the
    coordinator admitted it to (`events` of kind `admit`) and whether it was set aside."""
    out: dict[str, dict[str, dict[str, Any]]] = {"groups": {}, "rewards": {}}
    for name, by_execution in out.items():
        if name in reader.tables:
            by_execution.update((row["execution_id"], row) for row in reader.rows(name))
    admitted: dict[str, dict[str, Any]] = {}
    if "events" in reader.tables:
        for row in reader.rows("events"):
            if row["kind"] in ("admit", "set_aside"):
                detail = json.loads(row["detail"])
                entry = admitted.setdefault(detail["group"], {"batch": detail["batch"]})
                entry["set_aside"] = entry.get("set_aside", False) or row["kind"] == "set_aside"
    out["admitted"] = admitted
    return out


def store_table(reader: TraceReader, name: str) -> pa.Table:
    """A declared table as stored, strings resolved (int64, float64, bool, string columns)."""
    kinds = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
    spec = reader.tables[name]
    cols = reader.table(name)
    sch = pa.schema([pa.field(c, kinds[k]) for c, k in spec.columns])
    return pa.table([pa.array(cols[f.name], f.type) for f in sch], schema=sch)


def build_tables(
    reader: TraceReader,
    on_tokens: Callable[[pa.Table], None] | None = None,
    decode: Decode | None = None,
) -> dict[str, pa.Table]:
    """`executions`, `nodes` and every declared table of the trace, as pyarrow tables.

    `on_tokens`, if given, receives each execution's `tokens` rows as its tree is read, so
    the trace is walked once even when tokens are exported; `decode` adds `TEXT_COLUMNS`.
    """
    joins = _joins(reader)
    node_schema = schema(NODE_COLUMNS + (TEXT_COLUMNS if decode is not None else ()))
    rows, node_parts = [], [node_schema.empty_table()]
    for info, tree in executions(reader):
        cols = node_columns(tree, info.closed, decode)
        rows.append(_execution_row(info, tree, cols, joins))
        node_parts.append(pa.table(cols, schema=node_schema))
        if on_tokens is not None:
            on_tokens(tree_tokens(tree))
    tables = {
        "executions": pa.Table.from_pylist(rows, schema=schema(EXECUTION_COLUMNS)),
        "nodes": pa.concat_tables(node_parts),
    }
    for name in reader.tables:
        if name in tables:
            raise StoreError(f"{reader.path}: declared table {name!r} clashes with an export")
        tables[name] = store_table(reader, name)
    return tables


_PROVENANCE = pa.array(PROVENANCE_NAMES, pa.string())


def run_decoder(run_meta: dict[str, Any], path: Path) -> Decode:
    """Token ids -> text with the tokenizer of the run's model (a model spec or a Hugging
    Face directory, as `gyre run` was given it); StoreError when it cannot be loaded."""
    from gyre.errors import ConfigError
    from gyre.models import load_tokenizer

    model = run_meta.get("model")
    if not isinstance(model, str):
        raise StoreError(f"{path}: --text needs the run's model; its run metadata names none")
    try:
        tok = load_tokenizer(model)
    except ConfigError as e:
        raise StoreError(f"{path}: --text cannot load the run's tokenizer: {e}") from None

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False))

    return decode


def tree_tokens(tree: TrajectoryTree) -> pa.Table:
    """The `tokens` rows of one tree: every stored token, node by node, inputs first."""
    nodes = tree.nodes
    sizes = np.array([nd.num_tokens for nd in nodes], np.int64)
    total = int(sizes.sum())
    ids, prov, lps, out = [np.zeros(0, np.int32)], [np.zeros(0, np.uint8)], [], []
    for nd in nodes:
        n_in, n_out = len(nd.input_ids), len(nd.output_ids)
        ids += [nd.input_ids, nd.output_ids]
        prov += [nd.input_provenance, np.full(n_out, Provenance.POLICY, np.uint8)]
        lps += [np.full(n_in, np.nan, np.float32), nd.output_logprobs]
        out += [np.zeros(n_in, bool), np.ones(n_out, bool)]
    is_out = np.concatenate(out) if out else np.zeros(0, bool)
    first = np.repeat(np.cumsum(sizes) - sizes, sizes)
    arrays = [
        pa.DictionaryArray.from_arrays(np.zeros(total, np.int32), [tree.execution_id]),
        pa.array(np.repeat(np.arange(1, len(nodes) + 1, dtype=np.int32), sizes)),
        pa.array((np.arange(total) - first).astype(np.int32)),
        pa.array(is_out),
        pa.array(np.concatenate(ids).astype(np.int32, copy=False)),
        pa.DictionaryArray.from_arrays(np.concatenate(prov).astype(np.int8), _PROVENANCE),
        pa.array(np.concatenate(lps) if lps else np.zeros(0, np.float32), mask=~is_out),
    ]
    return pa.Table.from_arrays(arrays, schema=schema(TOKEN_COLUMNS))


# -- writing ----------------------------------------------------------------------------------


class _TableFile:
    """One exported table file, written in pieces (Parquet row groups or CSV chunks)."""

    def __init__(self, path: Path, sch: pa.Schema, fmt: str) -> None:
        self.path = path
        self.rows = 0
        self._pending: list[pa.Table] = []
        self._size = 0
        self._writer: Any = (
            pq.ParquetWriter(path, sch) if fmt == "parquet" else pa_csv.CSVWriter(path, sch)
        )

    def add(self, table: pa.Table) -> None:
        """Buffer rows; write a piece once about `ROW_GROUP` rows are pending."""
        self._pending.append(table)
        self._size += table.num_rows
        if self._size >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending))
            self.rows += self._size
            self._pending, self._size = [], 0

    def close(self) -> None:
        try:
            self._flush()
        finally:
            self._writer.close()


def export_trace(
    source: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "parquet",
    tokens: bool = False,
    text: bool = False,
) -> dict[str, Path]:
    """Write every table of the trace (and `tokens` if asked) to `out_dir`; {table: file}.
    `text`: the `nodes` table also holds each call's decoded input and output
    (`TEXT_COLUMNS`), with the tokenizer of the run's model (`run_meta["model"]`).

    `out_dir/run.json` gets the run's metadata (its config inside), the trace's format
    version, whether the writer had closed it, and each table's row count.
    """
    if fmt not in FORMATS:
        raise StoreError(f"format: {fmt!r}; allowed: {', '.join(FORMATS)}")
    path = trace_path(source)
    out = Path(out_dir)
    fsafe.check_outputs_apart({"--out": out}, {"the trace": path})
    files: dict[str, _TableFile] = {}
    with TraceReader(path) as reader:
        decode = run_decoder(reader.run_meta, path) if text else None
        with fsafe.writing(out):
            out.mkdir(parents=True, exist_ok=True)
            if tokens:
                files["tokens"] = _TableFile(out / f"tokens.{fmt}", schema(TOKEN_COLUMNS), fmt)
            try:
                tables = build_tables(reader, files["tokens"].add if tokens else None, decode)
            finally:
                for f in files.values():
                    f.close()
            for name, table in tables.items():
                files[name] = _TableFile(out / f"{name}.{fmt}", table.schema, fmt)
                files[name].add(table)
                files[name].close()
            meta = {
                "trace": str(path),
                "format_version": reader.format_version,
                "writer_closed": reader.writer_closed,
                "run_meta": reader.run_meta,
                "rows": {name: f.rows for name, f in files.items()},
            }
            (out / "run.json").write_text(json.dumps(meta, indent=1, allow_nan=False))
    return {name: f.path for name, f in files.items()}
