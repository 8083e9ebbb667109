"""The trace file's declared schema: HDF5 dtypes, dataset paths and the run's tables.

HDF5 SWMR forbids creating objects once a writer has switched to SWMR mode, so every
dataset a run will ever append to is declared here and created when the file is created
(`create_layout`); afterwards the writer only extends them. Strings (execution ids, roles,
engine ids, statuses, JSON metadata, table cells) live in one append-only string pool and
are referenced by their index, because SWMR does not support variable-length types.

Other parts add rows to the run's tables (`TraceWriter.append`). The default tables are in
`DEFAULT_TABLES`; a run may declare more with `Table(name, (("col", "int"), ...))`. Column
kinds: "int" (int64), "float" (float64), "bool", "str" (UTF-8, any length). The layout is
documented in docs/trace-format.md; change both together and bump FORMAT_VERSION.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import h5py
import numpy as np

from gyre.errors import StoreError
from gyre.trajectory.tree import Provenance

FORMAT_NAME = "gyre-trace"
FORMAT_VERSION = "1.3"  # major.minor; readers refuse another major (1.1: provenance enum
# type; 1.2: assessments.critique; 1.3: tokens/routed_experts and the node rows' routing_*)
KEY_BYTES = 32

STRINGS_DATA = "strings/data"  # uint8: UTF-8 bytes of every pooled string, back to back
STRINGS_END = "strings/end"  # int64: end offset of string i in strings/data
TOKEN_IDS = "tokens/ids"  # int32: every node's new input then output tokens
TOKEN_PROVENANCE = "tokens/provenance"  # PROVENANCE_DTYPE per token (POLICY for outputs)
LOGPROBS = "tokens/logprobs"  # float32: behaviour log-probs of output tokens only
ROUTED_EXPERTS = "tokens/routed_experts"  # int16: nodes' routed experts, [tokens, layers, top_k]
# each, flattened (C order), back to back; only nodes that have routing store any (1.3 on)
NODES = "trees/nodes"  # NODE_DTYPE rows of closed executions, contiguous per execution
EXECUTIONS = "trees/executions"  # EXECUTION_DTYPE: one row per closed execution (commit)
JOURNAL_OPENS = "journal/opens"  # OPEN_DTYPE: one row per opened execution
JOURNAL_NODES = "journal/nodes"  # NODE_DTYPE rows of nodes journaled while open
RUN_META = "run/meta"  # uint8: JSON of the run's metadata (config YAML inside)
RUN_STATE = "run/state"  # int8[1]: 0 while a writer has it open, 1 after a clean close

# an HDF5 enum over uint8: h5py, HDFView and h5dump show each code's name (policy, tool, ...)
PROVENANCE_DTYPE = h5py.enum_dtype({p.name.lower(): int(p) for p in Provenance}, basetype="u1")

ROUTING_FIELDS = (
    ("routing_start", "<i8"),  # into tokens/routed_experts; -1: the node has no routing
    ("routing_layers", "<i4"),  # the node's routed_experts shape [tokens, layers, top_k]
    ("routing_top_k", "<i4"),  # (0 and 0 when it has none)
)
"""The node row's fields added in 1.3; a 1.2 or older file's node rows lack them."""

NODE_DTYPE = np.dtype(
    [
        ("execution", "<u4"),  # string id of the execution id
        ("node_id", "<i4"),
        ("parent_id", "<i4"),
        ("token_start", "<i8"),  # into tokens/ids and tokens/provenance
        ("n_input", "<i8"),
        ("n_output", "<i8"),
        ("logprob_start", "<i8"),  # into tokens/logprobs
        ("role", "<u4"),  # string id
        ("policy_version", "<i8"),
        ("engine_id", "<u4"),  # string id
        ("finish_reason", "<u4"),  # string id
        ("t_start", "<f8"),
        ("t_end", "<f8"),
        ("attempts", "<i4"),
        ("input_key", "u1", (KEY_BYTES,)),
        ("input_key_len", "u1"),
        ("output_key", "u1", (KEY_BYTES,)),
        ("output_key_len", "u1"),
        *ROUTING_FIELDS,
    ]
)

EXECUTION_DTYPE = np.dtype(
    [
        ("execution", "<u4"),  # string id
        ("status", "<u4"),  # string id: "completed", "timeout", "error", ...
        ("meta", "<u4"),  # string id of a JSON object
        ("node_start", "<i8"),  # first row in trees/nodes
        ("node_count", "<i8"),
        ("t_open", "<f8"),
        ("t_close", "<f8"),
        ("num_leaves", "<i8"),
        ("unique_tokens", "<i8"),
        ("flat_tokens", "<i8"),
        ("unique_policy_tokens", "<i8"),
        ("flat_policy_tokens", "<i8"),
    ]
)

OPEN_DTYPE = np.dtype([("execution", "<u4"), ("meta", "<u4"), ("t_open", "<f8")])

COLUMN_KINDS = {"int": "<i8", "float": "<f8", "bool": "u1", "str": "<u4"}


@dataclass(frozen=True, slots=True)
class Table:
    """A declared append-only table: a name and (column, kind) pairs."""

    name: str
    columns: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise StoreError(f"table name: {self.name!r}; allowed: a Python identifier")
        names = [c for c, _ in self.columns]
        if not names or len(set(names)) != len(names):
            raise StoreError(f"table {self.name}: columns must be non-empty and unique")
        for col, kind in self.columns:
            if kind not in COLUMN_KINDS:
                raise StoreError(
                    f"table {self.name}: column {col!r} kind {kind!r}; allowed {list(COLUMN_KINDS)}"
                )

    @property
    def dtype(self) -> np.dtype:
        return np.dtype([(c, COLUMN_KINDS[k]) for c, k in self.columns])


def _t(name: str, *cols: str) -> Table:
    return Table(name, tuple(tuple(c.split(":")) for c in cols))  # type: ignore[misc]


DEFAULT_TABLES: tuple[Table, ...] = (
    # one row per evaluator attempt on a closed execution's preserved workspace
    _t(
        "assessments",
        "execution_id:str",
        "attempt:int",
        "score:float",
        "valid:bool",
        "state_ref:str",
        "evaluator:str",
        "detail:str",
        "t:float",
        "critique:str",
    ),
    # the reward an execution finally contributes, and whether it is valid
    _t("rewards", "execution_id:str", "group_id:str", "reward:float", "valid:bool", "t:float"),
    # group membership: one row per execution dispatched in a group
    _t(
        "groups",
        "group_id:str",
        "task_id:str",
        "execution_id:str",
        "policy_version:int",
        "t_dispatch:float",
    ),
    # the role timeline: cell `cell` held `role` from t_start to t_end
    _t("roles", "cell:int", "role:str", "t_start:float", "t_end:float"),
    # dispatch counters sampled by the coordinator
    _t(
        "dispatch",
        "t:float",
        "policy_version:int",
        "groups:int",
        "executions:int",
        "queued:int",
        "running:int",
        "closed:int",
    ),
    # step metrics in long form: one row per (step, metric)
    _t("steps", "step:int", "t:float", "name:str", "value:float"),
    # free-form events: kind plus a detail string (often JSON)
    _t("events", "t:float", "kind:str", "detail:str"),
)


def table_path(name: str) -> str:
    return f"tables/{name}"


def merge_tables(extra: Sequence[Table]) -> dict[str, Table]:
    """Default tables plus a run's own; a redeclared name must keep the same columns."""
    out = {t.name: t for t in DEFAULT_TABLES}
    for t in extra:
        if t.name in out and out[t.name] != t:
            raise StoreError(f"table {t.name}: already declared with columns {out[t.name].columns}")
        out[t.name] = t
    return out


def _extendable(f: h5py.File, path: str, dtype: np.dtype | str, chunk: int) -> None:
    f.create_dataset(path, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,))


def create_layout(
    f: h5py.File, tables: dict[str, Table], meta_json: bytes, *, token_chunk: int, row_chunk: int
) -> None:
    """Create every dataset of a new trace file (before SWMR mode starts)."""
    f.attrs["format"] = FORMAT_NAME
    f.attrs["format_version"] = FORMAT_VERSION
    flat = {TOKEN_IDS: "<i4", TOKEN_PROVENANCE: PROVENANCE_DTYPE, LOGPROBS: "<f4",
            ROUTED_EXPERTS: "<i2", STRINGS_DATA: "u1"}  # fmt: skip
    for path, dtype in flat.items():
        _extendable(f, path, dtype, token_chunk)
    _extendable(f, STRINGS_END, "<i8", row_chunk)
    _extendable(f, NODES, NODE_DTYPE, row_chunk)
    _extendable(f, JOURNAL_NODES, NODE_DTYPE, row_chunk)
    _extendable(f, EXECUTIONS, EXECUTION_DTYPE, row_chunk)
    _extendable(f, JOURNAL_OPENS, OPEN_DTYPE, row_chunk)
    for t in tables.values():
        ds = f.create_dataset(
            table_path(t.name), shape=(0,), maxshape=(None,), dtype=t.dtype, chunks=(row_chunk,)
        )
        ds.attrs["columns"] = ",".join(f"{c}:{k}" for c, k in t.columns)
    f.create_dataset(RUN_META, data=np.frombuffer(meta_json, np.uint8), dtype="u1")
    f.create_dataset(RUN_STATE, data=np.zeros(1, np.int8))


def check_version(f: h5py.File, path: str) -> str:
    """The file's format version; StoreError when it is not a trace this Gyre can read."""
    name = f.attrs.get("format")
    version = f.attrs.get("format_version")
    if isinstance(name, bytes):
        name = name.decode()
    if isinstance(version, bytes):
        version = version.decode()
    if name != FORMAT_NAME or not isinstance(version, str):
        raise StoreError(f"{path}: not a Gyre trace file (attribute format={name!r})")
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise StoreError(
            f"{path}: trace format_version {version} is not supported; "
            f"this Gyre reads {FORMAT_VERSION.split('.')[0]}.x"
        )
    return version


def table_from_attrs(name: str, spec: str) -> Table:
    """Rebuild a declared table from the `columns` attribute stored on its dataset."""
    return Table(name, tuple(tuple(c.split(":")) for c in spec.split(",")))  # type: ignore[misc]


def missing_columns(stored: Table) -> tuple[tuple[str, str], ...]:
    """The default table's columns a stored table lacks: a trace written by an older minor
    version (1.1 has no `assessments.critique`). Readers show them empty (`EMPTY`); a writer
    continuing such a trace leaves them out of its rows."""
    declared = {t.name: t for t in DEFAULT_TABLES}.get(stored.name)
    if declared is None:
        return ()
    have = {c for c, _ in stored.columns}
    return tuple((c, k) for c, k in declared.columns if c not in have)


def stores_routing(f: h5py.File) -> bool:
    """Whether the file stores nodes' routed experts (1.3 on; older node rows have no room)."""
    return ROUTED_EXPERTS in f and "routing_start" in (f[NODES].dtype.names or ())


def routing_end(rows: np.ndarray | np.void) -> np.ndarray:
    """Per node row, where its routing ends in tokens/routed_experts (0: none, or a file
    before 1.3): a row is complete only when this lies inside the dataset."""
    if "routing_start" not in (rows.dtype.names or ()):
        return np.zeros(np.shape(rows), np.int64)
    size = (rows["n_input"] + rows["n_output"]) * rows["routing_layers"] * rows["routing_top_k"]
    return np.where(rows["routing_start"] < 0, 0, rows["routing_start"] + size)


EMPTY = {"int": 0, "float": float("nan"), "bool": False, "str": ""}
"""What a column missing from an older trace reads as, by kind."""


# --- continuing a trace after its writer died ----------------------------------------------

_SUPERBLOCK_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def clear_write_flags(path: str) -> bool:
    """Clear the "open for (SWMR) write" flags a killed writer left in the superblock.

    What `h5clear -s --increment` does, for the superblock versions 2 and 3 the trace uses:
    the flags byte is zeroed, the end-of-file address raised to the file's size (space a
    dead writer allocated is never handed out twice) and the Jenkins lookup3 checksum
    recomputed. The stored checksum is verified first; anything unexpected is left alone
    (the open then fails with HDF5's own message). Returns True if the file was changed.
    """
    import os

    with open(path, "r+b") as f:
        head = bytearray(f.read(128))
        if head[:8] != _SUPERBLOCK_SIGNATURE or head[8] not in (2, 3) or head[9] != 8:
            return False
        end = 12 + 4 * 8  # base, extension, end-of-file, root addresses; then the checksum
        if int.from_bytes(head[end : end + 4], "little") != _lookup3(bytes(head[:end])):
            return False
        if head[11] == 0:
            return False
        head[11] = 0
        eof = int.from_bytes(head[28:36], "little")
        head[28:36] = max(eof, os.path.getsize(path)).to_bytes(8, "little")
        head[end : end + 4] = _lookup3(bytes(head[:end])).to_bytes(4, "little")
        f.seek(0)
        f.write(head[: end + 4])
    return True


def _lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 `hashlittle`, the checksum of HDF5 metadata."""
    m = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & m

    def mix(x: int, y: int, z: int, k: int) -> tuple[int, int]:
        """One line of lookup3's `mix` macro: x -= z; x ^= rot(z, k); z += y."""
        return ((x - z) & m) ^ rot(z, k), (z + y) & m

    def final(x: int, y: int, k: int) -> int:
        """One line of lookup3's `final` macro: x ^= y; x -= rot(y, k)."""
        return ((x ^ y) - rot(y, k)) & m

    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    i = 0
    while n > 12:
        a = (a + int.from_bytes(data[i : i + 4], "little")) & m
        b = (b + int.from_bytes(data[i + 4 : i + 8], "little")) & m
        c = (c + int.from_bytes(data[i + 8 : i + 12], "little")) & m
        a, c = mix(a, b, c, 4)
        b, a = mix(b, c, a, 6)
        c, b = mix(c, a, b, 8)
        a, c = mix(a, b, c, 16)
        b, a = mix(b, c, a, 19)
        c, b = mix(c, a, b, 4)
        i, n = i + 12, n - 12
    if n == 0:
        return c
    tail = data[i:] + bytes(12 - n)
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c = final(c, b, 14)
    a = final(a, c, 11)
    b = final(b, a, 25)
    c = final(c, b, 16)
    a = final(a, c, 4)
    b = final(b, a, 14)
    c = final(c, b, 24)
    return c
