"""`gyre trace show|export|stats`: inspect, export and summarize a run's trace file.

    gyre trace show runs/x/trace.h5                     # the run's executions
    gyre trace show runs/x/trace.h5 --execution g0-e3   # one execution's tree
    gyre trace show runs/x/trace.h5 --json              # the same as plain JSON
    gyre trace export runs/x --out runs/x/export        # flat Parquet tables (export.py)
    gyre trace export runs/x --format csv --tokens --out DIR   # CSV, plus one row per token
    gyre trace export runs/x --text --out DIR          # nodes with decoded input/output text
    gyre trace stats runs/x [--json]                    # staleness, tokens, trees, outcomes, switches

Human output uses rich tables; --json prints one JSON document (trees via
`TrajectoryTree.to_dict`, so token ids and log-probs are included). Open executions (never
closed, e.g. after a writer crash) are shown with status "open" from the journal. Every
action works on a live run or after a crash; a run directory stands for its `trace.h5`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from gyre import cliargs


def register(subparsers: Any) -> None:
    """Add `gyre trace show|export|stats` to the `gyre` command."""
    trace = subparsers.add_parser("trace", help="inspect HDF5 trace files")
    sub = trace.add_subparsers(dest="trace_command", metavar="ACTION")
    show = sub.add_parser("show", help="list a run's executions or print one execution's tree")
    show.add_argument("file", metavar="RUN_DIR|TRACE", help="run directory or trace file")
    show.add_argument("--execution", metavar="ID", help="print this execution's tree")
    show.add_argument("--json", action="store_true", help="print plain JSON")
    show.set_defaults(func=_show)
    export = sub.add_parser("export", help="write the trace as flat Parquet or CSV tables")
    export.add_argument("source", metavar="RUN_DIR|TRACE", help="run directory or trace file")
    export.add_argument("--format", choices=["parquet", "csv"], default="parquet")
    export.add_argument("--out", required=True, metavar="DIR", type=cliargs.directory_to_make,
                        help="output directory")  # fmt: skip
    export.add_argument("--tokens", action="store_true", help="also one row per stored token")
    export.add_argument("--text", action="store_true",
                        help="nodes also hold each call's decoded input and output text")  # fmt: skip
    export.set_defaults(func=_export)
    stats = sub.add_parser("stats", help="staleness, tokens, tree shape, outcomes, switches")
    stats.add_argument("source", metavar="RUN_DIR|TRACE", help="run directory or trace file")
    stats.add_argument("--json", action="store_true", help="print plain JSON")
    stats.set_defaults(func=_stats)
    trace.set_defaults(func=lambda args: (trace.print_help(), 2)[1])


def _show(args: argparse.Namespace) -> int:
    from gyre.trajectory.reader import TraceReader, trace_path

    with TraceReader(trace_path(args.file)) as reader:
        if args.execution is None:
            doc = _run_doc(reader)
            printer = _print_run
        else:
            doc = _execution_doc(reader, args.execution)
            printer = _print_tree
    return _emit(doc, printer, as_json=args.json)


def _export(args: argparse.Namespace) -> int:
    import time

    from gyre.trajectory.export import export_trace

    t0 = time.perf_counter()
    files = export_trace(args.source, args.out, fmt=args.format, tokens=args.tokens, text=args.text)
    print(f"exported {len(files)} tables to {args.out} in {time.perf_counter() - t0:.2f} s")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from gyre.trajectory.stats import print_stats, run_stats

    return _emit(run_stats(args.source), print_stats, as_json=args.json)


def _emit(doc: dict[str, Any], printer: Callable[[dict[str, Any]], None], *, as_json: bool) -> int:
    """Print `doc` as one JSON document, or for people with `printer`."""
    if as_json:
        json.dump(doc, sys.stdout, indent=1, allow_nan=False)
        sys.stdout.write("\n")
    else:
        printer(doc)
    return 0


def _run_doc(reader: Any) -> dict[str, Any]:
    return {
        "file": str(reader.path),
        "format_version": reader.format_version,
        "writer_closed": reader.writer_closed,
        "run_meta": reader.run_meta,
        "tables": reader.table_sizes(),
        "executions": [dataclasses.asdict(i) for i in reader.executions()],
    }


def _execution_doc(reader: Any, execution_id: str) -> dict[str, Any]:
    from gyre.errors import StoreError

    infos = {i.execution_id: i for i in reader.executions()}
    info = infos.get(execution_id)
    if info is None:
        raise StoreError(f"{reader.path}: no execution {execution_id!r}")
    tree = reader.tree(execution_id) if info.closed else reader.recover()[execution_id]
    return {
        "execution": dataclasses.asdict(info),
        "stats": dataclasses.asdict(tree.stats()),
        "leaves": tree.leaves(),
        "tree": tree.to_dict(),
    }


def _print_run(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    state = "closed cleanly" if doc["writer_closed"] else "being written or writer crashed"
    console.print(Text(f"{doc['file']}  format {doc['format_version']}  ({state})"))
    table = Table("execution", "status", "nodes", "leaves", "unique tok", "flat tok", "seconds")
    for e in doc["executions"]:
        secs = "" if e["t_close"] is None else f"{e['t_close'] - e['t_open']:.1f}"
        table.add_row(Text(e["execution_id"]), Text(e["status"]), str(e["num_nodes"]), str(e["num_leaves"]),
                      str(e["unique_tokens"]), str(e["flat_tokens"]), secs)  # fmt: skip
    console.print(table)
    sizes = ", ".join(f"{k}={v}" for k, v in doc["tables"].items())
    console.print(f"tables: {sizes}")


def _print_tree(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    e, s = doc["execution"], doc["stats"]
    console.print(
        Text(
            f"execution {e['execution_id']}  status {e['status']}  nodes {s['num_nodes']}  "
            f"leaves {s['num_leaves']}  unique tokens {s['unique_tokens']}  "
            f"flat tokens {s['flat_tokens']}"
        )
    )
    table = Table("node", "parent", "role", "input tok", "output tok", "policy", "engine",
                  "finish", "attempts", "leaf")  # fmt: skip
    leaves = set(doc["leaves"])
    for n in doc["tree"]["nodes"]:
        table.add_row(str(n["node_id"]), str(n["parent_id"]), Text(n["role"]),
                      str(len(n["input_ids"])), str(len(n["output_ids"])),
                      str(n["policy_version"]), Text(n["engine_id"]), Text(n["finish_reason"]),
                      str(n["attempts"]),
                      "yes" if n["node_id"] in leaves else "")  # fmt: skip
    console.print(table)
