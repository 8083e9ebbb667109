"""Reading a run's trace file: live (SWMR) while the writer runs, or after it has died.

`TraceReader` opens the file in SWMR read mode, which works both while a `TraceWriter` is
appending and after a writer was killed (the file is then still flagged as open for
writing, which a plain HDF5 open refuses). `refresh()` (called by the listing methods)
picks up rows appended since the last look. An execution is closed exactly when its row in
trees/executions is present and every row, token and string it references is inside the
datasets' current extents; executions opened but not closed are listed with status "open"
and `recover()` rebuilds their journaled nodes as partial trees.

    with TraceReader("runs/x/trace.h5") as r:
        for info in r.executions():
            print(info.execution_id, info.status, info.num_nodes)
        tree = r.tree("g0-e0")
        rewards = r.table("rewards")   # column name -> numpy array
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gyre.errors import StoreError
from gyre.trajectory import schema as S
from gyre.trajectory.tree import TrajectoryTree, TreeError

_COALESCE_GAP = 1 << 16  # read neighbouring token ranges in one request when this close


@dataclass(frozen=True, slots=True)
class ExecutionInfo:
    """One execution as listed by a reader; `closed` False means journaled only."""

    execution_id: str
    status: str  # the close status, or "open"
    closed: bool
    num_nodes: int
    num_leaves: int
    unique_tokens: int
    flat_tokens: int
    t_open: float
    t_close: float | None
    meta: dict[str, Any]


def _read_ranges(ds: h5py.Dataset, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Slices [a, b) of a 1-D dataset, reading nearby ranges together."""
    out: list[np.ndarray] = [np.zeros(0, ds.dtype)] * len(ranges)
    order = sorted((r for r in range(len(ranges)) if ranges[r][1] > ranges[r][0]),
                   key=lambda r: ranges[r][0])  # fmt: skip
    i = 0
    while i < len(order):
        start, end = ranges[order[i]]
        j = i + 1
        while j < len(order) and ranges[order[j]][0] <= end + _COALESCE_GAP:
            end = max(end, ranges[order[j]][1])
            j += 1
        block = ds[start:end]
        for k in order[i:j]:
            a, b = ranges[k]
            out[k] = block[a - start : b - start]
        i = j
    return out


class TraceReader:
    """Read-only, SWMR-capable view of a trace file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise StoreError(f"{self.path}: no such trace file")
        _refuse_truncated(self.path)
        try:
            self._f = h5py.File(self.path, "r", swmr=True, libver="latest")
        except OSError:
            try:
                self._f = h5py.File(self.path, "r")
            except OSError as e:
                raise StoreError(f"{self.path}: cannot open as HDF5 ({e})") from None
        try:
            self.format_version = S.check_version(self._f, str(self.path))
            self.stores_routing = S.stores_routing(self._f)  # False before 1.3: none read
            self.run_meta: dict[str, Any] = json.loads(bytes(self._f[S.RUN_META][()]).decode())
            self.tables = {
                name: S.table_from_attrs(name, ds.attrs["columns"])
                for name, ds in self._f["tables"].items()
            }
        except Exception:
            self._f.close()
            raise
        self._strings: list[str] = []
        self._sid: dict[str, int] = {}
        self._byte_end = 0
        self._closed_rows: dict[str, np.void] = {}
        self._opens: dict[str, tuple[int, float]] = {}  # execution -> (meta id, t_open)
        self._journal: dict[int, list[np.void]] = {}  # execution string id -> node rows
        self._seen = {S.EXECUTIONS: 0, S.JOURNAL_OPENS: 0, S.JOURNAL_NODES: 0}
        self.refresh()

    # -- live following ---------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up everything the writer flushed since the last refresh."""
        for ds in self._f.values():
            for sub in ds.values() if isinstance(ds, h5py.Group) else [ds]:
                if isinstance(sub, h5py.Dataset):
                    sub.refresh()
        self._load_strings()
        self._index_executions()
        self._index_journal()

    @property
    def writer_closed(self) -> bool:
        """True once the writer closed the file cleanly (False while live or after a crash)."""
        ds = self._f[S.RUN_STATE]
        ds.refresh()
        return bool(ds[0] == 1)

    def _load_strings(self) -> None:
        ends = self._f[S.STRINGS_END]
        data = self._f[S.STRINGS_DATA]
        new_ends = ends[len(self._strings) :]
        new_ends = new_ends[new_ends <= data.shape[0]]  # bytes not yet visible: later
        if not len(new_ends):
            return
        blob = bytes(data[self._byte_end : int(new_ends[-1])])
        base = self._byte_end
        for end in new_ends.tolist():
            text = blob[self._byte_end - base : end - base].decode("utf-8")
            self._sid.setdefault(text, len(self._strings))
            self._strings.append(text)
            self._byte_end = end

    def _str(self, sid: int) -> str:
        return self._strings[sid]

    def _visible(self, *sids: int) -> bool:
        return all(int(s) < len(self._strings) for s in sids)

    def _index_executions(self) -> None:
        rows = self._f[S.EXECUTIONS][self._seen[S.EXECUTIONS] :]
        n_nodes = self._f[S.NODES].shape[0]
        for row in rows:
            if not self._visible(row["execution"], row["status"], row["meta"]):
                break
            if row["node_start"] + row["node_count"] > n_nodes:
                break
            self._closed_rows[self._str(row["execution"])] = row
            self._journal.pop(int(row["execution"]), None)  # the closed tree supersedes it
            self._seen[S.EXECUTIONS] += 1
        opens = self._f[S.JOURNAL_OPENS][self._seen[S.JOURNAL_OPENS] :]
        for row in opens:
            if not self._visible(row["execution"], row["meta"]):
                break
            self._opens[self._str(row["execution"])] = (int(row["meta"]), float(row["t_open"]))
            self._seen[S.JOURNAL_OPENS] += 1

    def _index_journal(self) -> None:
        rows = self._f[S.JOURNAL_NODES][self._seen[S.JOURNAL_NODES] :]
        closed = {
            sid for sid in np.unique(rows["execution"]).tolist()
            if sid < len(self._strings) and self._strings[sid] in self._closed_rows
        }  # fmt: skip
        for row in rows:
            if int(row["execution"]) not in closed:
                self._journal.setdefault(int(row["execution"]), []).append(row)
        self._seen[S.JOURNAL_NODES] += len(rows)

    # -- executions -------------------------------------------------------------------------

    def executions(self) -> list[ExecutionInfo]:
        """Every execution of the run (closed and open), ordered by open time."""
        self.refresh()
        infos = [self._closed_info(eid, row) for eid, row in self._closed_rows.items()]
        for eid, (mid, t_open) in self._opens.items():
            if eid not in self._closed_rows:
                infos.append(self._open_info(eid, mid, t_open))
        infos.sort(key=lambda i: i.t_open)
        return infos

    def _closed_info(self, eid: str, row: np.void) -> ExecutionInfo:
        return ExecutionInfo(
            execution_id=eid,
            status=self._str(row["status"]),
            closed=True,
            num_nodes=int(row["node_count"]),
            num_leaves=int(row["num_leaves"]),
            unique_tokens=int(row["unique_tokens"]),
            flat_tokens=int(row["flat_tokens"]),
            t_open=float(row["t_open"]),
            t_close=float(row["t_close"]),
            meta=json.loads(self._str(row["meta"])),
        )

    def _open_info(self, eid: str, mid: int, t_open: float) -> ExecutionInfo:
        rows = self._complete(self._journal.get(self._sid.get(eid, -1), []), strict=False)
        depth = [0]
        for r in rows:
            depth.append(depth[int(r["parent_id"])] + int(r["n_input"] + r["n_output"]))
        parents = {int(r["parent_id"]) for r in rows}
        leaves = [int(r["node_id"]) for r in rows if int(r["node_id"]) not in parents]
        return ExecutionInfo(
            execution_id=eid,
            status="open",
            closed=False,
            num_nodes=len(rows),
            num_leaves=len(leaves),
            unique_tokens=sum(int(r["n_input"] + r["n_output"]) for r in rows),
            flat_tokens=sum(depth[i] for i in leaves),
            t_open=t_open,
            t_close=None,
            meta=json.loads(self._str(mid)),
        )

    def tree(self, execution_id: str) -> TrajectoryTree:
        """The closed execution's tree, equal to the one the writer was given."""
        row = self._closed_rows.get(execution_id)
        if row is None:
            self.refresh()
            row = self._closed_rows.get(execution_id)
        if row is None:
            if execution_id in self._opens:
                raise StoreError(
                    f"{self.path}: execution {execution_id!r} is open (never closed); "
                    "recover() rebuilds its journaled nodes"
                )
            raise StoreError(f"{self.path}: no execution {execution_id!r}")
        start, count = int(row["node_start"]), int(row["node_count"])
        rows = self._f[S.NODES][start : start + count]
        try:
            return self._build(execution_id, list(rows), strict=True)
        except (TreeError, StoreError, IndexError, ValueError) as e:
            raise StoreError(f"{self.path}: execution {execution_id!r} is corrupt ({e})") from e

    def recover(self) -> dict[str, TrajectoryTree]:
        """Partial trees of executions that were opened but never closed (from the journal)."""
        self.refresh()
        return {eid: self._recover_one(eid) for eid in self._opens if eid not in self._closed_rows}

    def _recover_one(self, eid: str) -> TrajectoryTree:
        return self._build(eid, self._journal.get(self._sid.get(eid, -1), []), strict=False)

    def _complete(self, rows: list[np.void], *, strict: bool) -> list[np.void]:
        """Leading rows whose tokens and strings are inside the file (all of them if strict)."""
        n_tok, n_lp = self._f[S.TOKEN_IDS].shape[0], self._f[S.LOGPROBS].shape[0]
        n_route = self._f[S.ROUTED_EXPERTS].shape[0] if self.stores_routing else 0
        good: list[np.void] = []
        for row in rows:
            complete = (
                row["token_start"] + row["n_input"] + row["n_output"] <= n_tok
                and row["logprob_start"] + row["n_output"] <= n_lp
                and S.routing_end(row) <= n_route
                and self._visible(row["role"], row["engine_id"], row["finish_reason"])
                and row["node_id"] == len(good) + 1
                and 0 <= row["parent_id"] <= len(good)
            )
            if not complete:
                if strict:
                    raise StoreError(f"node row {len(good) + 1} is incomplete or out of order")
                break
            good.append(row)
        return good

    def _build(self, eid: str, rows: list[np.void], *, strict: bool) -> TrajectoryTree:
        """Turn node rows into a tree; non-strict stops at the first incomplete row."""
        good = self._complete(rows, strict=strict)
        tok_ranges = [(int(r["token_start"]), int(r["token_start"] + r["n_input"] + r["n_output"]))
                      for r in good]  # fmt: skip
        lp_ranges = [(int(r["logprob_start"]), int(r["logprob_start"] + r["n_output"]))
                     for r in good]  # fmt: skip
        ids = _read_ranges(self._f[S.TOKEN_IDS], tok_ranges)
        prov = _read_ranges(self._f[S.TOKEN_PROVENANCE], tok_ranges)
        lps = _read_ranges(self._f[S.LOGPROBS], lp_ranges)
        routed = self._read_routing(good)
        tree = TrajectoryTree(eid)
        for row, i, p, lp, re in zip(good, ids, prov, lps, routed):
            n_in = int(row["n_input"])
            tree.add_node(**self._node_kwargs(row), input_ids=i[:n_in], input_provenance=p[:n_in],
                          output_ids=i[n_in:], output_logprobs=lp, routed_experts=re)  # fmt: skip
        return tree

    def _read_routing(self, rows: list[np.void]) -> list[np.ndarray | None]:
        """Each node row's routed experts, [tokens, layers, top_k]; None where it has none."""
        if not self.stores_routing:
            return [None] * len(rows)
        has = [int(r["routing_start"]) >= 0 for r in rows]
        ranges = [(int(r["routing_start"]), int(S.routing_end(r))) if h else (0, 0)
                  for r, h in zip(rows, has)]  # fmt: skip
        flat = _read_ranges(self._f[S.ROUTED_EXPERTS], ranges)
        shapes = [(int(r["n_input"] + r["n_output"]), int(r["routing_layers"]),
                   int(r["routing_top_k"])) for r in rows]  # fmt: skip
        return [f.reshape(shape) if h else None for f, shape, h in zip(flat, shapes, has)]

    def _node_kwargs(self, row: np.void) -> dict[str, Any]:
        return {
            "parent_id": int(row["parent_id"]),
            "role": self._str(row["role"]),
            "policy_version": int(row["policy_version"]),
            "engine_id": self._str(row["engine_id"]),
            "t_start": float(row["t_start"]),
            "t_end": float(row["t_end"]),
            "finish_reason": self._str(row["finish_reason"]),
            "input_key": bytes(row["input_key"][: row["input_key_len"]]),
            "output_key": bytes(row["output_key"][: row["output_key_len"]]),
            "attempts": int(row["attempts"]),
        }

    # -- tables -----------------------------------------------------------------------------

    def table(self, name: str) -> dict[str, np.ndarray]:
        """A declared table as columns; str columns are object arrays of str."""
        spec = self.tables.get(name)
        if spec is None:
            raise StoreError(f"table {name!r}: not in this file; tables: {sorted(self.tables)}")
        ds = self._f[S.table_path(name)]
        ds.refresh()
        self._load_strings()
        raw = ds[:]
        if len(raw):
            str_cols = [c for c, k in spec.columns if k == "str"]
            ok = np.ones(len(raw), bool)
            for c in str_cols:
                ok &= raw[c] < len(self._strings)
            raw = raw[: len(raw) if ok.all() else int(np.argmin(ok))]
        out: dict[str, np.ndarray] = {}
        for col, kind in spec.columns:
            if kind == "str":
                out[col] = np.array([self._strings[i] for i in raw[col]], dtype=object)
            else:
                out[col] = raw[col].astype(bool) if kind == "bool" else raw[col]
        for col, kind in S.missing_columns(spec):  # an older trace: the column reads as empty
            empty = np.full(len(raw), S.EMPTY[kind], dtype=object if kind == "str" else None)
            out[col] = empty.astype(bool) if kind == "bool" else empty
        return out

    def rows(self, name: str) -> list[dict[str, Any]]:
        """A declared table as a list of dicts of plain Python values."""
        cols = self.table(name)
        n = len(next(iter(cols.values()))) if cols else 0
        return [{c: v[i].item() if hasattr(v[i], "item") else v[i] for c, v in cols.items()}
                for i in range(n)]  # fmt: skip

    def table_sizes(self) -> dict[str, int]:
        """Row count of every declared table."""
        out = {}
        for name in self.tables:
            ds = self._f[S.table_path(name)]
            ds.refresh()
            out[name] = int(ds.shape[0])
        return out

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trace_path(source: str | Path) -> Path:
    """A run directory means its `trace.h5`; anything else is the trace file itself."""
    p = Path(source)
    return p / "trace.h5" if p.is_dir() else p


def _refuse_truncated(path: Path) -> None:
    """A cut-off HDF5 file makes a SWMR open retry its metadata reads for minutes; a plain
    open notices at once (other refusals, e.g. a live writer's flags, are left to SWMR)."""
    try:
        h5py.File(path, "r").close()
    except OSError as e:
        if "truncated" in str(e):
            raise StoreError(f"{path}: truncated HDF5 file ({e})") from None


def recover(path: str | Path) -> dict[str, TrajectoryTree]:
    """Journaled partial trees of the executions a (possibly crashed) writer left open."""
    with TraceReader(path) as reader:
        return reader.recover()
