"""Admin routes (separate admin token): executions, keys, the route table, engines.

    POST /admin/executions            {"execution_id", "role"?, "meta"?} -> {"key", ...}
    GET  /admin/executions            -> {"executions": [summary, ...]}
    GET  /admin/executions/{id}       -> summary (nodes, tokens, status)
    POST /admin/executions/{id}/close {"status"?, "meta"?} -> summary; writes the tree
    GET  /admin/routes                -> {"routes", "engines", "draining"}
    PUT  /admin/routes/{id}           {"engine_id"}: route an execution to an engine
    POST /admin/engines               {"engine_id", "url"}: add (or replace) an engine
    POST /admin/engines/{id}/drain    {"draining": true|false}: stop/resume new calls there

Requests carry `Authorization: Bearer <admin token>`; errors use OpenAI's error shape.
The coordinator in the same process uses the `ProxyApp` Python methods instead.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import TYPE_CHECKING, Any

from gyre.proxy.conversation import check_type, need, opt
from gyre.proxy.errors import ApiError, invalid
from gyre.proxy.handlers import JsonErrorHandler, bearer_key
from gyre.proxy.session import Execution

if TYPE_CHECKING:
    from gyre.proxy.app import ProxyApp


def summary(ex: Execution) -> dict[str, Any]:
    """What admin routes report about an execution."""
    stats = ex.tree.stats()
    return {
        "execution_id": ex.execution_id,
        "role": ex.role,
        "closed": ex.closed,
        "status": ex.status or ("closed" if ex.closed else "open"),
        "nodes": stats.num_nodes,
        "leaves": stats.num_leaves,
        "unique_tokens": stats.unique_tokens,
        "flat_tokens": stats.flat_tokens,
    }


class AdminHandler(JsonErrorHandler):
    api = "openai"

    def initialize(self, service: Any = None, app: ProxyApp | None = None) -> None:  # type: ignore[override]
        assert app is not None
        self.app = app
        self.service = app.service

    def prepare(self) -> None:
        token = bearer_key(self.request.headers) or ""
        if not hmac.compare_digest(token.encode(), self.app.admin_token.encode()):
            self.send_error_body(
                ApiError(
                    "authentication", "admin routes need 'Authorization: Bearer <admin token>'"
                )
            )

    def json_body(self) -> dict[str, Any]:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError as e:
            raise invalid(f"body: malformed JSON ({e})") from None
        return check_type(body, dict, "body")  # type: ignore[no-any-return]

    def _handle(self, fn: Any, *args: Any) -> None:
        try:
            self.send_json(fn(*args))
        except ApiError as e:
            self.send_error_body(e)


class ExecutionsHandler(AdminHandler):
    def post(self) -> None:
        def register() -> dict[str, Any]:
            body = self.json_body()
            eid = need(body, "execution_id", str, "body")
            role = opt(body, "role", str, "body")
            meta = opt(body, "meta", dict, "body")
            key = self.app.register_execution(eid, role, meta)
            return {"execution_id": eid, "key": key, "role": self.service.execution(eid).role}

        self._handle(register)

    def get(self) -> None:
        self._handle(lambda: {"executions": [summary(e) for e in self.service.executions.values()]})


class ExecutionHandler(AdminHandler):
    def get(self, execution_id: str) -> None:
        self._handle(lambda: summary(self.service.execution(execution_id)))


class CloseHandler(AdminHandler):
    async def post(self, execution_id: str) -> None:
        try:
            body = self.json_body()
            status = opt(body, "status", str, "body") or "completed"
            self.app.close_execution(execution_id, status, opt(body, "meta", dict, "body"))
        except ApiError as e:
            self.send_error_body(e)
            return
        ex = self.service.execution(execution_id)
        if ex.written is not None:  # answer once the tree is on disk, without blocking the loop
            try:
                await asyncio.wrap_future(ex.written)
            except Exception as e:
                self.send_error_body(ApiError("api_error", f"writing the tree failed: {e}"))
                return
        self.send_json(summary(ex))


class RoutesHandler(AdminHandler):
    def get(self) -> None:
        self._handle(self.service.router.table)


class RouteHandler(AdminHandler):
    def put(self, execution_id: str) -> None:
        def route() -> dict[str, Any]:
            engine_id = need(self.json_body(), "engine_id", str, "body")
            self.service.execution(execution_id)
            self.app.set_route(execution_id, engine_id)
            return {"execution_id": execution_id, "engine_id": engine_id}

        self._handle(route)

    post = put


class EnginesHandler(AdminHandler):
    def post(self) -> None:
        def add() -> dict[str, Any]:
            body = self.json_body()
            engine_id = need(body, "engine_id", str, "body")
            url = need(body, "url", str, "body")
            self.app.add_engine(engine_id, url)
            return {"engine_id": engine_id, "url": url}

        self._handle(add)


class DrainHandler(AdminHandler):
    def post(self, engine_id: str) -> None:
        def drain() -> dict[str, Any]:
            draining = opt(self.json_body(), "draining", bool, "body")
            draining = True if draining is None else draining
            self.app.set_draining(engine_id, draining)
            return {"engine_id": engine_id, "draining": draining}

        self._handle(drain)


ID = r"([A-Za-z0-9_.:@-]+)"
ROUTES: list[tuple[str, type[AdminHandler]]] = [
    (r"/admin/executions", ExecutionsHandler),
    (rf"/admin/executions/{ID}", ExecutionHandler),
    (rf"/admin/executions/{ID}/close", CloseHandler),
    (r"/admin/routes", RoutesHandler),
    (rf"/admin/routes/{ID}", RouteHandler),
    (r"/admin/engines", EnginesHandler),
    (rf"/admin/engines/{ID}/drain", DrainHandler),
]
