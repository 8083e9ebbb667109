"""The run's HDF5 trace store: one file per run, one writer, live SWMR readers.

The coordinator owns one `TraceWriter`. For every execution it calls `open_execution`,
then `record_node` for each model call (a journal: the node's tokens and row are appended
and flushed at once, so a killed writer loses nothing), and finally `close_execution` with
the whole `TrajectoryTree`, which writes the tree's node rows contiguously (reusing the
journaled tokens) and appends the execution's row LAST, after a flush: that row is the
commit marker. Other parts append rows to declared tables (`append`).

Every dataset is created with the file (HDF5 SWMR allows no new objects afterwards), so
readers in other processes (`TraceReader`, in gyre/trajectory/reader.py) can follow a
live run and can read a file whose writer was SIGKILLed: closed executions are intact,
open ones are listed with status "open" and rebuilt from the journal by `recover`.
Layout: docs/trace-format.md. The writer is not thread-safe; call it from one thread.

    with TraceWriter("runs/x/trace.h5", run_meta={"config": yaml_text}) as w:
        w.open_execution("g0-e0", {"task": "t1"})
        w.record_node("g0-e0", node)
        w.close_execution("g0-e0", tree, status="completed")
        w.append("rewards", [{"execution_id": "g0-e0", "group_id": "g0", ...}])
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gyre.errors import ConfigError, StoreError
from gyre.trajectory import schema as S
from gyre.trajectory.reader import ExecutionInfo, TraceReader, recover
from gyre.trajectory.tree import Node, Provenance, TrajectoryTree

log = logging.getLogger(__name__)

__all__ = [
    "ExecutionInfo",
    "StoreConfig",
    "TraceInputError",
    "TraceReader",
    "TraceWriter",
    "recover",
]


class TraceInputError(StoreError, ValueError):
    """A write was refused because its input is malformed; nothing was written."""


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """How the trace file is created."""

    # replace an existing file at the path (otherwise an existing file is an error)
    overwrite: bool = False
    # elements per chunk of the flat token / log-prob / string-byte datasets
    token_chunk: int = 1 << 16
    # rows per chunk of the node, execution, journal and table datasets
    row_chunk: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.token_chunk <= 1 << 24:
            raise ConfigError(f"token_chunk: {self.token_chunk}; allowed 1..{1 << 24}")
        if not 1 <= self.row_chunk <= 1 << 20:
            raise ConfigError(f"row_chunk: {self.row_chunk}; allowed 1..{1 << 20}")


@dataclass(frozen=True, slots=True)
class _Stored:
    """Where one node's data starts in the flat datasets (what its node row points to)."""

    token: int  # into tokens/ids and tokens/provenance
    logprob: int  # into tokens/logprobs
    routing: int  # into tokens/routed_experts; -1: none stored


@dataclass(slots=True)
class _Open:
    """Writer-side state of one open execution: where its journaled nodes' data lives."""

    t_open: float
    meta: dict[str, Any] = field(default_factory=dict)  # from open_execution
    journaled: list[tuple[Node, _Stored]] = field(default_factory=list)
    reopened: bool = False  # left open by a previous writer: its journal is not in memory

    def tree(self, execution_id: str) -> TrajectoryTree:
        """The journaled nodes as a tree (what the proxy recorded so far)."""
        tree = TrajectoryTree(execution_id)
        for node, _ in self.journaled:
            tree.append(node)
        return tree


def _utf8(what: str, s: Any) -> bytes:
    if not isinstance(s, str):
        raise TraceInputError(f"{what}: must be a str, got {type(s).__name__}")
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError:
        raise TraceInputError(f"{what}: {s!r} is not encodable as UTF-8") from None


def _json(what: str, meta: Any) -> str:
    if meta is None:
        meta = {}
    if not isinstance(meta, Mapping):
        raise TraceInputError(f"{what}: must be a dict, got {type(meta).__name__}")
    try:
        text = json.dumps(dict(meta), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TraceInputError(f"{what}: not JSON-serializable ({e})") from None
    _utf8(what, text)
    return text


def _check_node(where: str, node: Any) -> None:
    """Cheap structural checks of a node built outside `TrajectoryTree.add_node`."""
    if not isinstance(node, Node):
        raise TraceInputError(f"{where}: expected a Node, got {type(node).__name__}")
    arrays = (
        ("input_ids", np.int32, len(node.input_ids)),
        ("input_provenance", np.uint8, len(node.input_ids)),
        ("output_ids", np.int32, len(node.output_ids)),
        ("output_logprobs", np.float32, len(node.output_ids)),
    )
    for name, dtype, n in arrays:
        arr = getattr(node, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != (n,):
            raise TraceInputError(f"{where}: {name} must be a 1-D {np.dtype(dtype)} of length {n}")
    for name in ("input_key", "output_key"):
        key = getattr(node, name)
        if not isinstance(key, bytes) or len(key) > S.KEY_BYTES:
            raise TraceInputError(f"{where}: {name} must be bytes of length <= {S.KEY_BYTES}")
    for name in ("role", "engine_id", "finish_reason"):
        _utf8(f"{where}: {name}", getattr(node, name))
    _check_routing(where, node.routed_experts, node.num_tokens)


def _check_routing(where: str, routed: Any, n: int) -> None:
    """A node's routed experts: None, or int16 [n, layers, top_k] in -1..32767."""
    if routed is None:
        return
    is_array = isinstance(routed, np.ndarray)
    if not is_array or routed.dtype != np.int16 or routed.ndim != 3 or routed.shape[0] != n:
        got = f"{routed.dtype} {list(routed.shape)}" if is_array else type(routed).__name__
        raise TraceInputError(f"{where}: routed_experts must be None or an int16 array "
                              f"[{n}, layers, top_k] (one row per stored token), got {got}")  # fmt: skip
    if routed.size and int(routed.min()) < -1:
        raise TraceInputError(f"{where}: routed_experts holds {int(routed.min())}; "
                              "expert indices are -1 (unknown) .. 32767")  # fmt: skip


class TraceWriter:
    """The single writer of a run's trace file (SWMR mode from creation on)."""

    Config = StoreConfig

    def __init__(
        self,
        path: str | Path,
        *,
        run_meta: Mapping[str, Any],
        tables: Sequence[S.Table] = (),
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.config = config or StoreConfig()
        self.tables = S.merge_tables(tables)
        self._clock = clock
        meta = _json("run_meta", run_meta).encode()
        if self.path.exists() and not self.config.overwrite:
            raise StoreError(f"{self.path}: already exists (set overwrite to replace it)")
        # laid out under a side name and moved into place once in SWMR mode: a writer killed
        # before that leaves no trace that readers cannot open (HDF5 refuses a file whose
        # superblock says "open for write" without SWMR)
        creating = self.path.with_name(self.path.name + ".creating")
        try:
            self._f = h5py.File(creating, "w", libver="latest")
        except OSError as e:
            raise StoreError(f"{self.path}: cannot create trace file ({e})") from None
        try:
            S.create_layout(
                self._f,
                self.tables,
                meta,
                token_chunk=self.config.token_chunk,
                row_chunk=self.config.row_chunk,
            )
            self._f.swmr_mode = True
            os.replace(creating, self.path)
        except Exception:
            self._f.close()
            creating.unlink(missing_ok=True)
            raise
        self._node_dtype, self.stores_routing, self._routing_warned = S.NODE_DTYPE, True, False
        self._ds: dict[str, h5py.Dataset] = {}
        self._strings: dict[str, int] = {}
        self._open: dict[str, _Open] = {}
        self._closed: set[str] = set()
        self._alive = True
        self.repaired: dict[str, int] = {}  # rows a reopen cut from a crashed writer's tail

    @classmethod
    def reopen(
        cls, path: str | Path, *, config: StoreConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> TraceWriter:  # fmt: skip
        """Continue the trace at `path` — closed cleanly, or left by a killed writer.

        A killed writer's "open for write" flags are cleared (`schema.clear_write_flags`)
        and every dataset is cut back to its longest self-consistent prefix (a row only
        counts when every token, log-prob and string it references is in the file; the
        tail a crash left half-written is dropped and reported in `repaired`). Then the
        string pool and the closed / open executions are loaded and appending resumes: the
        run keeps one trace across resumes. Executions the dead writer left open stay
        journaled; close them (recovered) like any other. A trace of an older minor version
        is continued in its own layout: rows in its node dtype, and no routed experts
        before 1.3 (`stores_routing` False; nodes' routing is left out).
        """
        self = cls.__new__(cls)
        self.path, self.config, self._clock = Path(path), config or StoreConfig(), clock
        if not self.path.exists():
            raise StoreError(f"{self.path}: no trace to continue")
        S.clear_write_flags(str(self.path))
        try:
            self._f = _open_swmr_write(self.path)
        except OSError as e:
            raise StoreError(f"{self.path}: cannot reopen the trace ({e})") from None
        try:
            S.check_version(self._f, str(self.path))
            self.tables = {
                name: S.table_from_attrs(name, ds.attrs["columns"])
                for name, ds in self._f["tables"].items()
            }
            self.repaired = _repair(self._f)
            self._node_dtype = self._f[S.NODES].dtype
            self.stores_routing = S.stores_routing(self._f)
            self._routing_warned = False
            self._f[S.RUN_STATE][0] = 0
        except Exception:
            self._f.close()
            raise
        self._ds, self._alive = {}, True
        self._load_state()
        return self

    def _load_state(self) -> None:
        ends = self._f[S.STRINGS_END][:]
        blob = bytes(self._f[S.STRINGS_DATA][:])
        starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        self._strings = {}
        texts = []
        for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            text = blob[a:b].decode("utf-8")
            texts.append(text)
            self._strings.setdefault(text, i)
        execs = self._f[S.EXECUTIONS][:]
        self._closed = {texts[int(e)] for e in execs["execution"]}
        self._open = {}
        for row in self._f[S.JOURNAL_OPENS][:]:
            eid = texts[int(row["execution"])]
            if eid not in self._closed:
                meta = json.loads(texts[int(row["meta"])])
                self._open[eid] = _Open(t_open=float(row["t_open"]), meta=meta, reopened=True)

    # -- executions -------------------------------------------------------------------------

    def open_execution(self, execution_id: str, meta: Mapping[str, Any] | None = None) -> None:
        """Journal that an execution started (its nodes can be journaled from now on)."""
        self._check_alive()
        _utf8("execution_id", execution_id)
        if execution_id in self._open or execution_id in self._closed:
            state = "open" if execution_id in self._open else "closed"
            raise TraceInputError(f"execution {execution_id!r}: already {state} in this run")
        meta_text = _json(f"execution {execution_id!r} meta", meta)
        t_open = self._clock()
        with self._writing(f"open execution {execution_id!r}"):
            eid, mid = self._intern([execution_id, meta_text])
            self._append_rows(S.JOURNAL_OPENS, np.array([(eid, mid, t_open)], S.OPEN_DTYPE))
            self._f.flush()
        self._open[execution_id] = _Open(t_open=t_open, meta=json.loads(meta_text))

    def record_node(self, execution_id: str, node: Node) -> None:
        """Journal one node of an open execution and flush (~1 ms): a crash loses nothing."""
        self._check_alive()
        state = self._open.get(execution_id)
        if state is None:
            raise TraceInputError(self._not_open(execution_id))
        if state.reopened:
            raise TraceInputError(f"execution {execution_id!r}: left open by a dead writer; "
                                  "close it (recovered) instead of journaling more")  # fmt: skip
        where = f"execution {execution_id!r} node"
        _check_node(where, node)
        n = len(state.journaled)
        if node.node_id != n + 1 or not 0 <= node.parent_id <= n:
            raise TraceInputError(
                f"{where} {node.node_id} (parent {node.parent_id}): journal holds nodes 1..{n}; "
                f"next must be node {n + 1} with parent 0..{n}"
            )
        with self._writing(f"journal {where} {node.node_id}"):
            stored = self._append_tokens([node])
            self._append_rows(S.JOURNAL_NODES, self._node_rows(execution_id, [node], stored))
            self._f.flush()
        state.journaled.append((node, stored[0]))

    def close_execution(
        self,
        execution_id: str,
        tree: TrajectoryTree,
        *,
        status: str,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the execution's whole tree, then its row (the commit marker); flush both.

        The stored meta is the open meta updated by `meta`. Closing an execution that was
        never opened is allowed (nothing was journaled for it).
        """
        self._check_alive()
        self._check_close(execution_id, tree, status)
        state = self._open.get(execution_id) or _Open(t_open=self._clock())
        meta_text = _json(f"execution {execution_id!r} meta", meta)
        meta_text = _json("meta", {**state.meta, **json.loads(meta_text)})
        reuse = self._journal_reuse(state, tree)
        nodes = tree.nodes
        fresh = [n for n in nodes if n.node_id not in reuse]
        with self._writing(f"close execution {execution_id!r}"):
            stored = reuse | {n.node_id: s for n, s in zip(fresh, self._append_tokens(fresh))}
            rows = self._node_rows(execution_id, nodes, [stored[n.node_id] for n in nodes])
            node_start = self._append_rows(S.NODES, rows)
            self._f.flush()
            row = self._execution_row(execution_id, tree, status, meta_text, state, node_start)
            self._append_rows(S.EXECUTIONS, row)
            self._f.flush()
        self._open.pop(execution_id, None)
        self._closed.add(execution_id)

    def _check_close(self, execution_id: str, tree: Any, status: Any) -> None:
        _utf8("execution_id", execution_id)
        if execution_id in self._closed:
            raise TraceInputError(f"execution {execution_id!r}: already closed (duplicate close)")
        if not isinstance(tree, TrajectoryTree):
            raise TraceInputError(f"tree: expected a TrajectoryTree, got {type(tree).__name__}")
        if tree.execution_id != execution_id:
            raise TraceInputError(
                f"tree: belongs to execution {tree.execution_id!r}, not {execution_id!r}"
            )
        _utf8("status", status)
        if not status or status == "open":
            raise TraceInputError(
                f"status: {status!r}; a closed execution needs a non-empty "
                "status other than 'open' (e.g. 'completed', 'timeout')"
            )
        for node in tree.nodes:
            _check_node(f"execution {execution_id!r} node {node.node_id}", node)

    @staticmethod
    def _journal_reuse(state: _Open, tree: TrajectoryTree) -> dict[int, _Stored]:
        """Journaled nodes equal to the tree's: their tokens (and routing) are in the file."""
        out: dict[int, _Stored] = {}
        for jn, stored in state.journaled:
            if jn.node_id > len(tree):
                break
            tn = tree.node(jn.node_id)
            same = tn is jn or all(_same_array(getattr(tn, k), getattr(jn, k)) for k in _STORED)
            if same:
                out[jn.node_id] = stored
        return out

    def _execution_row(
        self, eid: str, tree: TrajectoryTree, status: str, meta: str, state: _Open, start: int
    ) -> np.ndarray:
        st = tree.stats()
        e, s, m = self._intern([eid, status, meta])
        values = (e, s, m, start, st.num_nodes, state.t_open, self._clock(), st.num_leaves,
                  st.unique_tokens, st.flat_tokens, st.unique_policy_tokens,
                  st.flat_policy_tokens)  # fmt: skip
        return np.array([values], S.EXECUTION_DTYPE)

    # -- tables -----------------------------------------------------------------------------

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append rows (dicts with exactly the table's columns) to a declared table; flush."""
        self._check_alive()
        spec = self.tables.get(table) if isinstance(table, str) else None
        if spec is None:
            raise TraceInputError(f"table {table!r}: not declared; declared: {sorted(self.tables)}")
        if isinstance(rows, Mapping | str | bytes):
            raise TraceInputError(f"table {table}: rows must be a list of dicts")
        rows = list(rows)
        if missing := {c for c, _ in S.missing_columns(spec)}:  # continuing an older trace
            rows = [{k: v for k, v in r.items() if k not in missing} if isinstance(r, Mapping) else r
                    for r in rows]  # fmt: skip
        for i, row in enumerate(rows):
            _check_table_row(spec, i, row)
        if not rows:
            return
        with self._writing(f"append to table {table}"):
            arr = np.zeros(len(rows), spec.dtype)
            for col, kind in spec.columns:
                values = [r[col] for r in rows]
                arr[col] = self._intern(values) if kind == "str" else values
            self._append_rows(S.table_path(table), arr)
            self._f.flush()

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def open_executions(self) -> list[str]:
        """Executions opened and not yet closed, in open order."""
        return list(self._open)

    def journaled_tree(self, execution_id: str) -> TrajectoryTree:
        """The tree of an open execution's journaled nodes (this writer's journal)."""
        state = self._open.get(execution_id)
        if state is None:
            raise TraceInputError(self._not_open(execution_id))
        return state.tree(execution_id)

    def flush(self) -> None:
        """Push everything written so far to the file (writes already flush themselves)."""
        self._check_alive()
        with self._writing("flush"):
            self._f.flush()

    def close(self) -> None:
        """Mark the file cleanly closed and close it. Open executions stay journaled."""
        if not self._alive:
            return
        self._alive = False
        try:
            self._f[S.RUN_STATE][0] = 1
            self._f.flush()
        finally:
            self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- low level --------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self._alive:
            raise StoreError(f"{self.path}: the trace writer is closed")

    def _not_open(self, execution_id: Any) -> str:
        if execution_id in self._closed:
            return f"execution {execution_id!r}: already closed; cannot journal more nodes"
        return f"execution {execution_id!r}: not open (call open_execution first)"

    def _writing(self, what: str) -> _WriteGuard:
        return _WriteGuard(f"{self.path}: {what}")

    def _dataset(self, path: str) -> h5py.Dataset:
        ds = self._ds.get(path)
        if ds is None:
            ds = self._ds[path] = self._f[path]
        return ds

    def _append_rows(self, path: str, arr: np.ndarray) -> int:
        """Extend a 1-D dataset by `arr`; returns the index of its first new element."""
        ds = self._dataset(path)
        n = ds.shape[0]
        if len(arr):
            ds.resize((n + len(arr),))
            ds[n:] = arr
        return n

    def _intern(self, values: Sequence[str]) -> list[int]:
        """String-pool ids for `values`, appending unseen strings to the pool first."""
        new = [v for v in dict.fromkeys(values) if v not in self._strings]
        if new:
            blobs = [v.encode("utf-8") for v in new]
            start = self._append_rows(S.STRINGS_DATA, np.frombuffer(b"".join(blobs), np.uint8))
            ends = start + np.cumsum([len(b) for b in blobs], dtype=np.int64)
            first = self._append_rows(S.STRINGS_END, ends)
            self._strings.update({v: first + i for i, v in enumerate(new)})
        return [self._strings[v] for v in values]

    def _append_tokens(self, nodes: Sequence[Node]) -> list[_Stored]:
        """Write the nodes' tokens, log-probs and routing back to back; where each starts."""
        if not nodes:
            return []
        ids, prov, lps = [], [], []
        for n in nodes:
            ids += [n.input_ids, n.output_ids]
            prov += [n.input_provenance, np.full(len(n.output_ids), Provenance.POLICY, np.uint8)]
            lps.append(n.output_logprobs)
        routed = [n.routed_experts for n in nodes if n.routed_experts is not None]
        if routed and not self.stores_routing:
            self._warn_routing_left_out()
            routed = []
        tok = self._append_rows(S.TOKEN_IDS, np.concatenate(ids).astype(np.int32, copy=False))
        self._append_rows(S.TOKEN_PROVENANCE, np.concatenate(prov).astype(np.uint8, copy=False))
        lp = self._append_rows(S.LOGPROBS, np.concatenate(lps).astype(np.float32, copy=False))
        route = -1  # where the next node's routing starts; -1: none is written
        if routed:
            route = self._append_rows(S.ROUTED_EXPERTS, np.concatenate([r.ravel() for r in routed]))
        out = []
        for n in nodes:
            r = n.routed_experts if route >= 0 else None
            out.append(_Stored(tok, lp, -1 if r is None else route))
            tok, lp = tok + n.num_tokens, lp + len(n.output_ids)
            route += 0 if r is None else r.size
        return out

    def _warn_routing_left_out(self) -> None:
        if not self._routing_warned:
            self._routing_warned = True
            log.warning("%s: trace format %s stores no routed experts; nodes' routing is "
                        "left out of this file", self.path, self._f.attrs["format_version"])  # fmt: skip

    def _node_rows(
        self, execution_id: str, nodes: Sequence[Node], stored: Sequence[_Stored]
    ) -> np.ndarray:
        """Node rows in the file's node dtype (an older trace's rows have no routing fields)."""
        rows = np.zeros(len(nodes), self._node_dtype)
        rows["execution"] = self._intern([execution_id])[0]
        for col in ("node_id", "parent_id", "policy_version", "t_start", "t_end", "attempts"):
            rows[col] = [getattr(n, col) for n in nodes]
        for col in ("role", "engine_id", "finish_reason"):
            rows[col] = self._intern([getattr(n, col) for n in nodes])
        rows["token_start"] = [s.token for s in stored]
        rows["logprob_start"] = [s.logprob for s in stored]
        rows["n_input"] = [len(n.input_ids) for n in nodes]
        rows["n_output"] = [len(n.output_ids) for n in nodes]
        for i, n in enumerate(nodes):
            for col in ("input_key", "output_key"):
                key = getattr(n, col)
                rows[col][i, : len(key)] = np.frombuffer(key, np.uint8)
                rows[f"{col}_len"][i] = len(key)
        if self.stores_routing:
            dims = [
                (0, 0) if n.routed_experts is None else n.routed_experts.shape[1:] for n in nodes
            ]
            rows["routing_start"] = [s.routing for s in stored]
            rows["routing_layers"] = [d[0] for d in dims]
            rows["routing_top_k"] = [d[1] for d in dims]
        return rows


_STORED = ("input_ids", "input_provenance", "output_ids", "output_logprobs", "routed_experts")
"""A node's arrays in the flat datasets: a journaled node whose arrays equal the closed
tree's is not written again."""


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and np.array_equal(a, b)


class _WriteGuard:
    """Turns low-level HDF5 failures during a write into a StoreError naming the write."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type | None, exc: BaseException | None, tb: object) -> None:
        if (
            exc is not None
            and not isinstance(exc, StoreError)
            and isinstance(exc, OSError | RuntimeError | ValueError | KeyError)
        ):
            raise StoreError(f"{self.what} failed: {exc}") from exc


def _open_swmr_write(path: Path) -> h5py.File:
    """`path` opened for writing in SWMR mode from the first moment. Opened in plain write
    mode and switched after (`swmr_mode = True`), a writer killed in between (while it
    repairs a long trace, say) would leave the superblock saying "open for write", which no
    reader may open until a writer clears it. Nothing is created in a trace once laid out,
    and SWMR allows cutting datasets back (`_repair`)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE, fapl)
    return h5py.File(fid)


def _repair(f: h5py.File) -> dict[str, int]:
    """Cut every dataset back to its longest self-consistent prefix; rows dropped per path.

    Appends always write referenced data (tokens, strings, node rows) before the rows that
    reference them, so after a crash only a tail can be inconsistent.
    """
    dropped: dict[str, int] = {}

    def cut(path: str, n: int) -> None:
        ds = f[path]
        if ds.shape[0] > n:
            dropped[path] = ds.shape[0] - n
            ds.resize((n,))

    ends = f[S.STRINGS_END][:]
    n_str = int(np.searchsorted(ends, f[S.STRINGS_DATA].shape[0], side="right"))
    cut(S.STRINGS_END, n_str)
    cut(S.STRINGS_DATA, int(ends[n_str - 1]) if n_str else 0)
    n_tok = min(f[S.TOKEN_IDS].shape[0], f[S.TOKEN_PROVENANCE].shape[0])
    cut(S.TOKEN_IDS, n_tok)
    cut(S.TOKEN_PROVENANCE, n_tok)
    n_lp = f[S.LOGPROBS].shape[0]
    n_route = f[S.ROUTED_EXPERTS].shape[0] if S.stores_routing(f) else 0

    def node_ok(r: np.ndarray) -> np.ndarray:
        return (
            (r["token_start"] + r["n_input"] + r["n_output"] <= n_tok)
            & (r["logprob_start"] + r["n_output"] <= n_lp)
            & (S.routing_end(r) <= n_route)
            & (r["execution"] < n_str) & (r["role"] < n_str) & (r["engine_id"] < n_str)
            & (r["finish_reason"] < n_str)
        )  # fmt: skip

    for path in (S.NODES, S.JOURNAL_NODES):
        cut(path, _prefix(f[path], node_ok))
    n_nodes = f[S.NODES].shape[0]
    cut(S.EXECUTIONS, _prefix(f[S.EXECUTIONS], lambda r: (
        (r["node_start"] + r["node_count"] <= n_nodes) & (r["execution"] < n_str)
        & (r["status"] < n_str) & (r["meta"] < n_str))))  # fmt: skip
    cut(S.JOURNAL_OPENS, _prefix(f[S.JOURNAL_OPENS],
                                 lambda r: (r["execution"] < n_str) & (r["meta"] < n_str)))  # fmt: skip
    for name, ds in f["tables"].items():
        cols = [c for c, k in S.table_from_attrs(name, ds.attrs["columns"]).columns if k == "str"]

        def ok(r: np.ndarray, cols: list[str] = cols) -> np.ndarray:
            return np.logical_and.reduce([r[c] < n_str for c in cols] or [np.ones(len(r), bool)])

        cut(S.table_path(name), _prefix(ds, ok))
    f.flush()
    return dropped


def _prefix(ds: h5py.Dataset, ok: Callable[[np.ndarray], np.ndarray], block: int = 4096) -> int:
    """Length of the longest prefix of `ds` whose rows all pass `ok` (scanned from the end)."""
    n = ds.shape[0]
    while n > 0:
        start = max(0, n - block)
        good = ok(ds[start:n])
        if good.all():
            return n
        first_bad = int(np.argmin(good))
        if first_bad > 0:  # the rows before it are good (a crash only spoils a tail)
            return start + first_bad
        n = start
    return 0


def _check_table_row(spec: S.Table, i: int, row: Any) -> None:
    where = f"table {spec.name} row {i}"
    if not isinstance(row, Mapping):
        raise TraceInputError(f"{where}: must be a dict, got {type(row).__name__}")
    cols = [c for c, _ in spec.columns]
    if set(row) != set(cols):
        extra, missing = sorted(set(row) - set(cols)), [c for c in cols if c not in row]
        raise TraceInputError(
            f"{where}: unknown columns {extra}, missing columns {missing}; columns are {cols}"
        )
    for col, kind in spec.columns:
        _check_cell(f"{where} column {col!r}", kind, row[col])


def _check_cell(where: str, kind: str, v: Any) -> None:
    is_bool = isinstance(v, bool | np.bool_)
    if kind == "str":
        _utf8(where, v)
    elif kind == "bool":
        if not is_bool:
            raise TraceInputError(f"{where}: expected a bool, got {v!r}")
    elif kind == "int":
        if is_bool or not isinstance(v, int | np.integer) or not -(2**63) <= int(v) < 2**63:
            raise TraceInputError(f"{where}: expected an int64, got {v!r}")
    elif is_bool or not isinstance(v, int | float | np.integer | np.floating):
        raise TraceInputError(f"{where}: expected a float, got {v!r}")
    elif isinstance(v, int) and abs(v) > 2**1023:
        raise TraceInputError(f"{where}: {v!r} does not fit a float64")
