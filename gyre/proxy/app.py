"""`ProxyApp`: the harness-facing proxy as a Tornado application plus a Python API.

    app = ProxyApp(Config(model_names=["gyre-tiny"]), tokenizer=tok,
                   engines={"e0": "http://127.0.0.1:30000"}, admin_token=token, store=writer)
    port = app.listen(0)                     # on the running IOLoop
    key = app.register_execution("g0-e0", role="main")
    ...                                       # harness calls /v1/messages with `key`
    tree = app.close_execution("g0-e0", "completed")

The Python methods mirror the admin routes (for the coordinator in the same process) and
must be called on the IOLoop's thread. `gyre.proxy.testing.running_proxy` runs one in a
background thread for tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import tornado.httpserver
import tornado.netutil
import tornado.web

from gyre.proxy import admin, handlers
from gyre.proxy.config import Config
from gyre.proxy.recorder import StoreSink
from gyre.proxy.routing import EngineLike, Router
from gyre.proxy.service import ProxyService
from gyre.proxy.tito import ChatRenderer
from gyre.rollout.client import EngineClient
from gyre.trajectory.tree import TrajectoryTree

LISTEN_BACKLOG = 1024  # connections the kernel queues for accept (Tornado's default: 128)


class ProxyApp:
    """Executions, keys, routes and both client APIs behind one HTTP server."""

    def __init__(
        self,
        config: Config,
        *,
        tokenizer: Any,
        engines: Mapping[str, str | EngineLike],
        admin_token: str,
        store: Any = None,
    ) -> None:
        if len(admin_token) < 8:
            raise ValueError("admin_token: must be at least 8 characters")
        self.config = config
        self.admin_token = admin_token
        router = Router(attempts=config.reroute_attempts, wait_s=config.reroute_wait_s)
        self.store = StoreSink(store) if store is not None else None
        self.service = ProxyService(config, ChatRenderer(tokenizer), router, store=self.store)
        self._own_clients: dict[str, EngineClient] = {}  # made here from URLs: closed here
        for engine_id, engine in engines.items():
            self.add_engine(engine_id, engine)
        self.server: tornado.httpserver.HTTPServer | None = None
        self.metrics = admin.ProxyMetrics()  # served at /metrics

    # -- Python API (same as the admin routes) ----------------------------------------------

    def register_execution(
        self, execution_id: str, role: str | None = None, meta: Mapping[str, Any] | None = None
    ) -> str:
        """Open an execution with a role label; returns its API key."""
        return self.service.register_execution(execution_id, role, meta)

    def close_execution(
        self, execution_id: str, status: str = "completed", meta: Mapping[str, Any] | None = None
    ) -> TrajectoryTree:
        """Close an execution and return its tree; the store write is queued (`flush_store`)."""
        return self.service.close_execution(execution_id, status, meta)

    def forget_execution(self, execution_id: str) -> None:
        """Drop a closed execution's tree (the caller has it elsewhere); its id stays taken
        and its calls stay counted in /metrics."""
        tree = self.service.execution(execution_id).tree
        self.service.forget_execution(execution_id)
        self.metrics.forget(execution_id, tree)

    def tree(self, execution_id: str) -> TrajectoryTree:
        return self.service.execution(execution_id).tree

    def set_route(self, execution_id: str, engine_id: str) -> None:
        """Send the execution's next calls (and retries of aborted ones) to `engine_id`."""
        self.service.router.set_route(execution_id, engine_id)

    def set_draining(self, engine_id: str, draining: bool = True) -> None:
        """Stop (or resume) starting new calls at an engine."""
        self.service.router.set_draining(engine_id, draining)

    def add_engine(self, engine_id: str, engine: str | EngineLike) -> None:
        """Add an engine by URL (or an engine client object); replaces one with that id
        (e.g. an engine restarted on another port), whose idle connections are closed."""
        old = self._own_clients.pop(engine_id, None)
        if isinstance(engine, str):
            engine = self._own_clients[engine_id] = EngineClient(
                engine, engine_id=engine_id, timeout=self.config.engine_timeout_s
            )
        self.service.router.add_engine(engine_id, engine)
        if old is not None:
            old.close()

    def routes(self) -> dict[str, Any]:
        return self.service.router.table()

    # -- HTTP -------------------------------------------------------------------------------

    def application(self) -> tornado.web.Application:
        rules: list[Any] = [(path, h, {"app": self}) for path, h in admin.ROUTES]
        rules += [(path, h, {"service": self.service}) for path, h in handlers.ROUTES]
        return admin.MeteredApplication(
            self.metrics,
            rules,
            default_handler_class=handlers.NotFoundHandler,
            default_handler_args={"service": self.service},
        )

    def listen(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Start serving on the current IOLoop; returns the bound port."""
        self.server = tornado.httpserver.HTTPServer(  # model calls raise their own body limit
            self.application(),
            max_body_size=self.config.max_body_bytes,
            idle_connection_timeout=3600,
        )
        sockets = tornado.netutil.bind_sockets(port, host, backlog=LISTEN_BACKLOG)
        self.server.add_sockets(sockets)
        return int(sockets[0].getsockname()[1])

    def stop(self) -> None:
        """Stop listening; answer every call in flight with the retryable overloaded error
        (503, Anthropic 529; its engine call is cancelled, no node recorded), then close the
        client connections (a request read before that gets the same answer). Open
        executions stay open; their nodes are journaled."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        self.service.close()
        for client in self._own_clients.values():
            client.close()
        if server is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop runs: nothing is served on these connections
                return
            self._closing = loop.create_task(server.close_all_connections())

    def flush_store(self) -> None:
        """Block until every queued store write (journal, closed trees) is on disk."""
        if self.store is not None:
            self.store.flush()

    def close_store(self) -> None:
        """Finish pending journal writes and close the trace writer."""
        if self.store is not None:
            self.store.close()
            self.store = self.service.store = None
