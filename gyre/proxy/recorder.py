"""`StoreSink`: the proxy's side of the HDF5 trace store, off the IOLoop thread.

A journal write (`TraceWriter.record_node`) flushes the file, which costs milliseconds to
tens of milliseconds on a busy disk; done on the IOLoop it would stall every harness. The
sink runs all writer calls on one worker thread, in submission order (the writer is not
thread-safe, and a node must be journaled after its execution was opened and before it is
closed). Every call returns a `Future` at once; the admin close route awaits its future
(without blocking the IOLoop), so a closed execution's tree is on disk when it answers.
`flush` and `close` block until everything queued is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gyre.trajectory.tree import Node, TrajectoryTree

log = logging.getLogger(__name__)


class StoreSink:
    """Serializes a `TraceWriter`'s calls onto one background thread."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gyre-proxy-store")
        self.errors = 0

    def open_execution(self, execution_id: str, meta: Mapping[str, Any]) -> Future[None]:
        return self._submit(self.writer.open_execution, execution_id, dict(meta))

    def record_node(self, execution_id: str, node: Node) -> Future[None]:
        return self._submit(self.writer.record_node, execution_id, node)

    def close_execution(
        self, execution_id: str, tree: TrajectoryTree, *, status: str, meta: Mapping[str, Any]
    ) -> Future[None]:
        return self._submit(
            self.writer.close_execution, execution_id, tree, status=status, meta=dict(meta)
        )

    def _submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future[None]:
        fut = self._pool.submit(fn, *args, **kwargs)
        fut.add_done_callback(self._report)
        return fut

    def flush(self) -> None:
        """Wait until every submitted write is done."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Finish pending writes, close the writer, stop the thread."""
        try:
            self._pool.submit(self.writer.close).result()
        finally:
            self._pool.shutdown(wait=True)

    def _report(self, fut: Future[None]) -> None:
        exc = fut.exception()
        if exc is not None:
            self.errors += 1
            log.error("trace store write failed: %s", exc)
