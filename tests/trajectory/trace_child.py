"""Child processes for the trace store tests (run as real subprocesses).

    python trace_child.py write PATH   # journal and close executions forever, report progress
    python trace_child.py read PATH    # SWMR reader: on each stdin line, refresh and report
    python trace_child.py die-creating PATH   # SIGKILLed once a new trace is laid out
    python trace_child.py die-reopening PATH  # SIGKILLed once a reopen has repaired the trace

The writer keeps three executions open at a time, journals one node per step round-robin,
and prints `journaled EID N`, `closed EID`, `opened EID` after each write returned (so
every printed fact is flushed to the file). Trees come from `make_tree(i, f"exec-{i}", ...)`,
every other one with routed experts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from trajectory_strategies import make_tree

from gyre.trajectory import store
from gyre.trajectory.store import TraceReader, TraceWriter


def expected_tree(i: int):
    """Execution i's tree; odd ones carry routed experts (8 layers, top 2) on most nodes."""
    return make_tree(i, f"exec-{i}", 8 + i % 13, routing=(8, 2) if i % 2 else None)


def tree_digest(tree) -> str:
    return hashlib.sha256(json.dumps(tree.to_dict(), sort_keys=True).encode()).hexdigest()


def write(path: str) -> None:
    w = TraceWriter(path, run_meta={"config": "child: true\n"})
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    next_i, step, live = 0, 0, []
    while True:
        step += 1
        while len(live) < 3:
            tree = expected_tree(next_i)
            w.open_execution(tree.execution_id, {"i": next_i})
            say("opened", tree.execution_id)
            live.append([tree, 0])
            next_i += 1
        slot = live[step % len(live)]
        tree, k = slot
        if k < len(tree):
            w.record_node(tree.execution_id, tree.nodes[k])
            slot[1] = k + 1
            say("journaled", tree.execution_id, k + 1)
        else:
            w.close_execution(tree.execution_id, tree, status="completed", meta={"n": len(tree)})
            say("closed", tree.execution_id)
            live.remove(slot)


def read(path: str) -> None:
    r = TraceReader(path)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        doc = {}
        for info in r.executions():
            digest = tree_digest(r.tree(info.execution_id)) if info.closed else None
            doc[info.execution_id] = [info.status, info.num_nodes, digest]
        print(json.dumps(doc), flush=True)
    r.close()


def _killed_after(module: object, name: str) -> None:
    """`module.name`, made to SIGKILL this process as soon as it returns (a kill that lands
    while the writer opens the file, before it would hand it to anyone)."""
    real = getattr(module, name)

    def then_die(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(module, name, then_die)


def die_creating(path: str) -> None:
    _killed_after(store.S, "create_layout")
    TraceWriter(path, run_meta={"config": "child: true\n"})


def die_reopening(path: str) -> None:
    _killed_after(store, "_repair")
    TraceWriter.reopen(path)


if __name__ == "__main__":
    modes = {"write": write, "read": read, "die-creating": die_creating,
             "die-reopening": die_reopening}  # fmt: skip
    modes[sys.argv[1]](sys.argv[2])
