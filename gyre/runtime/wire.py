"""Control messages over MPI between the coordinator, the proxy node and the cells.

Messages are small pickled tuples whose first element names them (docs/runtime.md lists
every one). Two tags: `UP` for anything sent to the coordinator, `DOWN` for what the
coordinator sends. MPI orders messages between one pair of ranks on one tag, which the
protocol relies on (a proxy's "terminated" always precedes its "assessed"). Receivers poll
with `Iprobe` so that every wait has a deadline and a dead peer cannot hang the world.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from gyre.errors import GyreError

UP, DOWN = 21, 22


class RuntimeFailure(GyreError):
    """The run cannot continue (a component failed, a wait ran past its deadline)."""


def send(comm: Any, msg: tuple, dest: int, tag: int) -> None:
    comm.send(msg, dest=dest, tag=tag)


def poll(
    comm: Any,
    source: int | None,
    tag: int,
    timeout: float,
    idle_s: float = 0.001,
    max_idle_s: float = 0.02,
) -> Any | None:
    """The next message from `source` (None: any) on `tag`, or None after `timeout`.

    Waits with `Iprobe` and a sleep that grows from `idle_s` to `max_idle_s` while nothing
    arrives: a blocking MPI receive busy-polls a core in MPICH, and an idle rank of a
    latency-bound job (harnesses waiting on tools) should cost nothing. A message that
    arrives after a quiet spell waits at most `max_idle_s`.
    """
    from mpi4py import MPI

    if source is None:
        source = MPI.ANY_SOURCE
    deadline = time.monotonic() + timeout
    status = MPI.Status()
    delay = idle_s
    while True:
        if comm.Iprobe(source=source, tag=tag, status=status):
            return comm.recv(source=status.Get_source(), tag=tag)
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(delay * 1.5, max_idle_s)


def abort_world(rank: int, component: str, error: BaseException) -> None:
    """Print one clear line (and the traceback for non-Gyre errors), then abort every rank."""
    from mpi4py import MPI

    if not isinstance(error, GyreError):
        traceback.print_exception(error, file=sys.stderr)
    print(f"gyre run: error on rank {rank} ({component}): {error}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)
