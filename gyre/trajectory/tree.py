"""Trajectory trees: one prefix-sharing tree of model calls per execution.

Every model call an execution makes becomes one `Node`. A node stores only the tokens that
are new relative to its parent: `input_ids` (what was appended after the parent's output)
and `output_ids` (what the engine sampled). The exact context the engine received for a call
is therefore the concatenation of `(input_ids, output_ids)` over the root-to-node path,
minus the node's own output (`context_ids`).

The proxy decides where a call attaches: it computes chain keys over the request's canonical
messages and looks them up, longest first, with `find_by_output_key` (or `deepest_match`);
a hit means the request continues that node's path and the node's recorded tokens are reused
verbatim; no hit attaches the call to the virtual root (node 0). Diverging contexts branch
(two children of one parent); two calls that happen to produce equal text are still two
nodes (no content deduplication), and a key lookup returns the latest of them.

The tree is pure logic (no I/O, no clock). Costs: `add_node` is O(new tokens), key lookup is
O(1), `stats` is O(nodes) (flat token counts come from per-node depth sums, never from
expanding paths), `context_ids` / `materialize` are O(path tokens).

    tree = TrajectoryTree("exec-0")
    n1 = tree.add_node(parent_id=0, input_ids=prompt, input_provenance=prov, ...)
    rows = tree.materialize(tree.leaves()[0])   # ids, provenance, logprobs, trainable mask
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.errors import GyreError

MAX_KEY_BYTES = 32
_INT32 = np.iinfo(np.int32)


class TreeError(GyreError, ValueError):
    """A node or tree is malformed (bad dtype, mismatched lengths, unknown parent, ...)."""


class Provenance(enum.IntEnum):
    """Who authored a token; one uint8 per token. Only POLICY tokens are training targets."""

    POLICY = 0  # sampled by a rollout engine under the policy: the ONLY eligible target
    SYSTEM = 1  # system prompt, tool schemas
    USER = 2  # user messages
    TOOL = 3  # tool results
    INJECTED = 4  # assistant-role text supplied by the harness (not sampled by us)
    EVALUATOR = 5  # evaluator-authored text a later call sees (never a target)
    TEMPLATE = 6  # chat-template markup: role headers, generation prompt, separators


_MAX_PROVENANCE = max(Provenance)


@dataclass(slots=True, eq=False)
class Node:
    """One model call: the new input tokens after the parent's output, and the sampled output."""

    node_id: int  # 1..n within its execution (0 = virtual root)
    parent_id: int  # 0 = attached to the root
    input_ids: np.ndarray  # int32: this call's NEW input tokens (after parent's output)
    input_provenance: np.ndarray  # uint8, len == len(input_ids)
    output_ids: np.ndarray  # int32: tokens the engine sampled (all POLICY provenance)
    output_logprobs: np.ndarray  # float32 behaviour log-probs, len == len(output_ids)
    role: str  # role label: "main", "subagent", "compaction", ...
    policy_version: int  # weight_version of the engine that served the call
    engine_id: str
    t_start: float  # unix seconds
    t_end: float
    finish_reason: str  # "stop" | "length" | "tool_calls" ... (engine's finish type)
    input_key: bytes  # opaque match key of the context BEFORE the output (<= 32 B)
    output_key: bytes  # opaque match key of context + this call's output (<= 32 B)
    attempts: int = 1  # how many engine attempts (reroutes) this one node took
    routed_experts: np.ndarray | None = None
    # int16 [num_tokens, layers, top_k] of a mixture-of-experts policy, None where the engine
    # reported none: row i holds the experts the engine routed the position *before* segment
    # token i to (the position whose hidden state predicted token i), one row per MoE layer;
    # -1 where unknown (the first token of a root-attached call has no position before it)

    @property
    def num_tokens(self) -> int:
        """Tokens this node stores (new input + output)."""
        return len(self.input_ids) + len(self.output_ids)


@dataclass(slots=True)
class PathTokens:
    """One root-to-node path flattened into training-ready token rows."""

    ids: np.ndarray  # int32 token ids
    provenance: np.ndarray  # uint8 Provenance per token
    logprobs: np.ndarray  # float32 behaviour log-probs; NaN where provenance != POLICY
    node_of_token: np.ndarray  # int32 node id that stored each token
    trainable: np.ndarray  # bool: provenance == POLICY
    routing: np.ndarray | None = None
    # int16 [T, layers, top_k]: the experts the engine routed each position to (-1 unknown;
    # the last position predicts nothing and is always unknown); None: no node has routing


@dataclass(slots=True, frozen=True)
class TreeStats:
    """Size of a tree: what is stored once versus what flat per-leaf expansion would cost."""

    num_nodes: int
    num_leaves: int
    unique_tokens: int  # tokens stored (each node's new input + output, counted once)
    flat_tokens: int  # sum over leaves of the full path length in tokens
    unique_policy_tokens: int  # sampled tokens stored
    flat_policy_tokens: int  # sum over leaves of the sampled tokens on the path


def _int_array(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind == "f":
        arr = arr.astype(np.int32)  # an empty list arrives as float64
    if arr.ndim != 1:
        raise TreeError(f"{name}: must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TreeError(f"{name}: must hold integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < _INT32.min or int(arr.max()) > _INT32.max):
        raise TreeError(f"{name}: values must fit int32")
    return arr


def _frozen(arr: np.ndarray, dtype: type) -> np.ndarray:
    out: np.ndarray = np.array(arr, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out


def _check_provenance(prov: np.ndarray) -> None:
    if prov.size == 0:
        return
    lo, hi = int(prov.min()), int(prov.max())
    if lo < 0 or hi > _MAX_PROVENANCE:
        raise TreeError(f"input_provenance: values must be Provenance codes 0..{_MAX_PROVENANCE}")
    if lo == Provenance.POLICY:
        raise TreeError(
            "input_provenance: POLICY (0) is reserved for output tokens sampled in this call; "
            "use INJECTED for assistant text the engine did not sample here"
        )


def _check_logprobs(name: str, value: Any, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind in "fiu":
        arr = arr.astype(np.float32)
    if arr.ndim != 1 or arr.dtype.kind != "f":
        raise TreeError(f"{name}: must be a 1-D float array, got {arr.dtype} {arr.shape}")
    with np.errstate(over="ignore"):
        arr = arr.astype(np.float32, copy=False)
    if len(arr) != n:
        raise TreeError(f"{name}: length {len(arr)} != len(output_ids) {n}")
    if not np.isfinite(arr).all():
        raise TreeError(f"{name}: log-probs must be finite (no NaN / inf)")
    return arr


def _check_key(name: str, key: Any) -> bytes:
    if not isinstance(key, bytes):
        raise TreeError(f"{name}: must be bytes, got {type(key).__name__}")
    if len(key) > MAX_KEY_BYTES:
        raise TreeError(f"{name}: {len(key)} bytes; at most {MAX_KEY_BYTES} allowed")
    return key


def _check_routing(value: Any, n: int) -> np.ndarray | None:
    """A node's routed experts: None, or integers [n, layers, top_k] in -1..32767."""
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.ndim != 3 or arr.shape[0] != n or arr.dtype.kind not in "iu":
        raise TreeError(f"routed_experts: must be integers [{n}, layers, top_k] "
                        f"(one row per stored token), got {arr.dtype} {list(arr.shape)}")  # fmt: skip
    if arr.size and (int(arr.min()) < -1 or int(arr.max()) > np.iinfo(np.int16).max):
        raise TreeError("routed_experts: expert indices must be -1 (unknown) .. 32767")
    return arr


def _check_scalars(
    role: Any, engine_id: Any, finish_reason: Any, policy_version: Any, attempts: Any
) -> None:
    for name, v in (("role", role), ("engine_id", engine_id), ("finish_reason", finish_reason)):
        if not isinstance(v, str):
            raise TreeError(f"{name}: must be a str, got {type(v).__name__}")
    if not role:
        raise TreeError("role: must be a non-empty string (e.g. 'main', 'subagent')")
    if not isinstance(policy_version, int | np.integer) or isinstance(policy_version, bool):
        raise TreeError(f"policy_version: must be an int, got {policy_version!r}")
    if not -(2**63) <= int(policy_version) < 2**63:
        raise TreeError(f"policy_version: {policy_version} does not fit int64")
    if not isinstance(attempts, int | np.integer) or isinstance(attempts, bool):
        raise TreeError(f"attempts: must be an int, got {attempts!r}")
    if not 1 <= int(attempts) <= _INT32.max:
        raise TreeError(f"attempts: {attempts}; allowed 1..{_INT32.max}")


def _check_times(t_start: Any, t_end: Any) -> tuple[float, float]:
    try:
        a, b = float(t_start), float(t_end)
    except (TypeError, ValueError):
        raise TreeError(f"t_start/t_end: must be numbers, got {t_start!r}, {t_end!r}") from None
    if not (math.isfinite(a) and math.isfinite(b)):
        raise TreeError(f"t_start/t_end: must be finite, got {a}, {b}")
    if b < a:
        raise TreeError(f"t_end: {b} is before t_start {a}")
    return a, b


def path_routing(path: Sequence[Node]) -> np.ndarray | None:
    """Per-position routed experts of a root-to-node path (`PathTokens.routing`): the nodes'
    rows, each the routing of the position before its token, shifted one position back;
    -1 where a node has none and at the last position. None when no node has any."""
    shapes = {n.routed_experts.shape[1:] for n in path if n.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise TreeError(f"routed_experts: nodes of one path have shapes {sorted(shapes)}")
    (shape,) = shapes
    rows = [n.routed_experts if n.routed_experts is not None
            else np.full((n.num_tokens, *shape), -1, np.int16) for n in path]  # fmt: skip
    before = np.concatenate(rows)  # before[t]: the routing of position t - 1
    return np.concatenate([before[1:], np.full((1, *shape), -1, np.int16)])


@dataclass(slots=True, eq=False)
class TrajectoryTree:
    """All model calls of one execution, as a prefix-sharing tree under a virtual root (0)."""

    execution_id: str
    _nodes: list[Node] = field(default_factory=list, init=False, repr=False)
    _children: list[list[int]] = field(default_factory=lambda: [[]], init=False, repr=False)
    _depth_tokens: list[int] = field(default_factory=lambda: [0], init=False, repr=False)
    _depth_policy: list[int] = field(default_factory=lambda: [0], init=False, repr=False)
    _by_output_key: dict[bytes, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.execution_id, str):
            raise TreeError(f"execution_id: must be a str, got {type(self.execution_id).__name__}")

    # -- building ---------------------------------------------------------------------------

    def add_node(
        self,
        *,
        parent_id: int,
        input_ids: Any,
        input_provenance: Any,
        output_ids: Any,
        output_logprobs: Any,
        role: str,
        policy_version: int,
        engine_id: str,
        t_start: float,
        t_end: float,
        finish_reason: str,
        input_key: bytes,
        output_key: bytes,
        attempts: int = 1,
        routed_experts: Any = None,
    ) -> Node:
        """Validate and append one call; its arrays are copied and frozen. O(new tokens)."""
        if not isinstance(parent_id, int | np.integer) or not 0 <= parent_id <= len(self._nodes):
            raise TreeError(
                f"parent_id: {parent_id!r} is not a node of execution {self.execution_id!r}; "
                f"allowed 0 (root) .. {len(self._nodes)}"
            )
        ids = _int_array("input_ids", input_ids)
        prov = _int_array("input_provenance", input_provenance)
        if len(prov) != len(ids):
            raise TreeError(f"input_provenance: length {len(prov)} != len(input_ids) {len(ids)}")
        _check_provenance(prov)
        out = _int_array("output_ids", output_ids)
        lps = _check_logprobs("output_logprobs", output_logprobs, len(out))
        _check_scalars(role, engine_id, finish_reason, policy_version, attempts)
        t0, t1 = _check_times(t_start, t_end)
        routed = _check_routing(routed_experts, len(ids) + len(out))
        node = Node(
            node_id=len(self._nodes) + 1,
            parent_id=int(parent_id),
            input_ids=_frozen(ids, np.int32),
            input_provenance=_frozen(prov, np.uint8),
            output_ids=_frozen(out, np.int32),
            output_logprobs=_frozen(lps, np.float32),
            role=role,
            policy_version=int(policy_version),
            engine_id=engine_id,
            t_start=t0,
            t_end=t1,
            finish_reason=finish_reason,
            input_key=_check_key("input_key", input_key),
            output_key=_check_key("output_key", output_key),
            attempts=int(attempts),
            routed_experts=None if routed is None else _frozen(routed, np.int16),
        )
        self._link(node)
        return node

    def append(self, node: Node) -> Node:
        """Append a node already built and validated elsewhere (its frozen arrays are shared).

        For nodes of this execution recorded by another process (the journal): its id must
        be the next one and its parent a node already in the tree.
        """
        n = len(self._nodes)
        if not isinstance(node, Node) or node.node_id != n + 1 or not 0 <= node.parent_id <= n:
            raise TreeError(f"append: node must be number {n + 1} with a parent in 0..{n}")
        self._link(node)
        return node

    def _link(self, node: Node) -> None:
        self._nodes.append(node)
        self._children.append([])
        self._children[node.parent_id].append(node.node_id)
        self._depth_tokens.append(self._depth_tokens[node.parent_id] + node.num_tokens)
        self._depth_policy.append(self._depth_policy[node.parent_id] + len(node.output_ids))
        self._by_output_key[node.output_key] = node.node_id

    # -- lookup -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def nodes(self) -> list[Node]:
        """All nodes in creation order (node_id == index + 1)."""
        return list(self._nodes)

    def node(self, node_id: int) -> Node:
        """The node with that id (1..n)."""
        if not isinstance(node_id, int | np.integer) or not 1 <= node_id <= len(self._nodes):
            raise TreeError(
                f"node_id: {node_id!r} not in execution {self.execution_id!r} "
                f"(allowed 1..{len(self._nodes)})"
            )
        return self._nodes[node_id - 1]

    def find_by_output_key(self, key: bytes) -> Node | None:
        """The latest node whose output_key equals `key`, or None. O(1)."""
        nid = self._by_output_key.get(key)
        return None if nid is None else self._nodes[nid - 1]

    def deepest_match(self, chain_keys: Sequence[bytes]) -> tuple[int, Node] | None:
        """Longest prefix of a request's chain keys that ends at a recorded output.

        Returns (index into chain_keys, node) for the last key found, or None (attach to
        the root). O(number of keys).
        """
        for i in range(len(chain_keys) - 1, -1, -1):
            hit = self.find_by_output_key(chain_keys[i])
            if hit is not None:
                return i, hit
        return None

    def children(self, node_id: int) -> list[int]:
        """Ids of the direct children of a node (0 = root), in creation order."""
        if node_id != 0:
            self.node(node_id)
        return list(self._children[node_id])

    def leaves(self) -> list[int]:
        """Ids of nodes without children, in creation order: one trajectory each."""
        return [n.node_id for n in self._nodes if not self._children[n.node_id]]

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root (exclusive) down to `node_id` (inclusive)."""
        self.node(node_id)
        out: list[int] = []
        while node_id:
            out.append(node_id)
            node_id = self._nodes[node_id - 1].parent_id
        out.reverse()
        return out

    def path_length(self, node_id: int) -> int:
        """Tokens on the path through this node's output. O(1)."""
        if node_id != 0:
            self.node(node_id)
        return self._depth_tokens[node_id]

    # -- materialization --------------------------------------------------------------------

    def context_ids(self, node_id: int) -> np.ndarray:
        """Exactly the input ids the engine received for that call (int32)."""
        parts: list[np.ndarray] = []
        ids = self.path(node_id)
        for nid in ids:
            node = self._nodes[nid - 1]
            parts.append(node.input_ids)
            if nid != ids[-1]:
                parts.append(node.output_ids)
        return np.concatenate(parts).astype(np.int32, copy=False)

    def full_ids(self, node_id: int) -> np.ndarray:
        """Context plus this node's output: the tokens a continuation of it starts from."""
        if node_id == 0:
            return np.zeros(0, np.int32)
        return np.concatenate([self.context_ids(node_id), self.node(node_id).output_ids])

    def materialize(self, node_id: int) -> PathTokens:
        """Flatten the path through `node_id` (including its output) into token rows."""
        ids, prov, lps, owner = [], [], [], []
        path = [self._nodes[nid - 1] for nid in self.path(node_id)]
        for node in path:
            nid = node.node_id
            n_in, n_out = len(node.input_ids), len(node.output_ids)
            ids += [node.input_ids, node.output_ids]
            prov += [node.input_provenance, np.full(n_out, Provenance.POLICY, np.uint8)]
            lps += [np.full(n_in, np.nan, np.float32), node.output_logprobs]
            owner.append(np.full(n_in + n_out, nid, np.int32))
        provenance = np.concatenate(prov).astype(np.uint8, copy=False)
        return PathTokens(
            ids=np.concatenate(ids).astype(np.int32, copy=False),
            provenance=provenance,
            logprobs=np.concatenate(lps).astype(np.float32, copy=False),
            node_of_token=np.concatenate(owner),
            trainable=provenance == Provenance.POLICY,
            routing=path_routing(path),
        )

    def stats(self) -> TreeStats:
        """Stored versus flat-expanded token counts, from per-node depth sums. O(nodes)."""
        leaves = self.leaves()
        return TreeStats(
            num_nodes=len(self._nodes),
            num_leaves=len(leaves),
            unique_tokens=sum(n.num_tokens for n in self._nodes),
            flat_tokens=sum(self._depth_tokens[i] for i in leaves),
            unique_policy_tokens=sum(len(n.output_ids) for n in self._nodes),
            flat_policy_tokens=sum(self._depth_policy[i] for i in leaves),
        )

    # -- equality and JSON ------------------------------------------------------------------

    def diff(self, other: TrajectoryTree) -> list[str]:
        """Human-readable differences to `other` (empty when the trees are equal)."""
        return tree_diff(self, other)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrajectoryTree):
            return NotImplemented
        return not tree_diff(self, other)

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (keys as hex, arrays as lists); `from_dict` inverts it exactly."""
        return {
            "execution_id": self.execution_id,
            "nodes": [node_to_dict(n) for n in self._nodes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrajectoryTree:
        """Rebuild a tree written by `to_dict`, validating every node."""
        if not isinstance(data, dict) or "execution_id" not in data or "nodes" not in data:
            raise TreeError("tree dict: needs keys 'execution_id' and 'nodes'")
        tree = cls(data["execution_id"])
        for i, nd in enumerate(data["nodes"], start=1):
            if not isinstance(nd, dict) or nd.get("node_id") != i:
                raise TreeError(f"tree dict: node #{i} must be a dict with node_id {i}")
            tree.add_node(**node_kwargs_from_dict(nd))
        return tree


_NODE_SCALARS = (
    "parent_id",
    "role",
    "policy_version",
    "engine_id",
    "t_start",
    "t_end",
    "finish_reason",
    "attempts",
)
_NODE_ARRAYS = ("input_ids", "input_provenance", "output_ids", "output_logprobs")


def node_to_dict(node: Node) -> dict[str, Any]:
    """A JSON-safe dict of one node."""
    d: dict[str, Any] = {"node_id": node.node_id}
    d.update({k: getattr(node, k) for k in _NODE_SCALARS})
    d.update({k: getattr(node, k).tolist() for k in _NODE_ARRAYS})
    d["input_key"] = node.input_key.hex()
    d["output_key"] = node.output_key.hex()
    if node.routed_experts is not None:
        d["routed_experts"] = node.routed_experts.tolist()
    return d


def node_kwargs_from_dict(d: dict[str, Any]) -> dict[str, Any]:
    """`add_node` keyword arguments from a `node_to_dict` dict."""
    missing = [k for k in (*_NODE_SCALARS, *_NODE_ARRAYS, "input_key", "output_key") if k not in d]
    if missing:
        raise TreeError(f"node dict: missing keys {missing}")
    kw: dict[str, Any] = {k: d[k] for k in _NODE_SCALARS}
    kw["input_ids"] = np.asarray(d["input_ids"], dtype=np.int64)
    kw["input_provenance"] = np.asarray(d["input_provenance"], dtype=np.int64)
    kw["output_ids"] = np.asarray(d["output_ids"], dtype=np.int64)
    kw["output_logprobs"] = np.asarray(d["output_logprobs"], dtype=np.float32)
    try:
        kw["input_key"] = bytes.fromhex(d["input_key"])
        kw["output_key"] = bytes.fromhex(d["output_key"])
    except (TypeError, ValueError):
        raise TreeError("node dict: input_key/output_key must be hex strings") from None
    if d.get("routed_experts") is not None:
        kw["routed_experts"] = np.asarray(d["routed_experts"], dtype=np.int64)
    return kw


def node_diff(a: Node, b: Node) -> list[str]:
    """Fields in which two nodes differ (arrays compared by dtype and exact value)."""
    out = [
        f"{k}: {getattr(a, k)!r} != {getattr(b, k)!r}"
        for k in ("node_id", *_NODE_SCALARS, "input_key", "output_key")
        if getattr(a, k) != getattr(b, k)
    ]
    for k in (*_NODE_ARRAYS, "routed_experts"):
        x, y = getattr(a, k), getattr(b, k)
        if x is None or y is None:
            if (x is None) != (y is None):
                out.append(f"{k}: present in one node only")
            continue
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            out.append(f"{k}: {x.dtype}{list(x.shape)} differs from {y.dtype}{list(y.shape)}")
    return out


def tree_diff(a: TrajectoryTree, b: TrajectoryTree) -> list[str]:
    """Differences between two trees, prefixed with the node they concern."""
    out: list[str] = []
    if a.execution_id != b.execution_id:
        out.append(f"execution_id: {a.execution_id!r} != {b.execution_id!r}")
    if len(a) != len(b):
        out.append(f"node count: {len(a)} != {len(b)}")
    for x, y in zip(a.nodes, b.nodes):
        out += [f"node {x.node_id}: {d}" for d in node_diff(x, y)]
    return out


def trees_equal(a: TrajectoryTree, b: TrajectoryTree) -> bool:
    """True when both trees hold the same nodes with bit-identical arrays."""
    return not tree_diff(a, b)
