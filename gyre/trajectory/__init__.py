"""The trajectory plane's data: per-execution trajectory trees and the HDF5 trace store.

`tree` holds the pure prefix-sharing tree of model calls (`TrajectoryTree`, `Node`,
`Provenance`); `store` writes and reads one HDF5 file per run (`TraceWriter`, `TraceReader`,
`recover`); `cli` is `gyre trace show`. The file layout is documented in docs/trace-format.md.
"""

from gyre.trajectory.tree import (
    Node,
    PathTokens,
    Provenance,
    TrajectoryTree,
    TreeError,
    TreeStats,
    tree_diff,
    trees_equal,
)

__all__ = [
    "Node",
    "PathTokens",
    "Provenance",
    "TrajectoryTree",
    "TreeError",
    "TreeStats",
    "tree_diff",
    "trees_equal",
]
