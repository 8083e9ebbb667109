"""Admin routes (separate admin token): executions, keys, the route table, engines.

    POST /admin/executions            {"execution_id", "role"?, "meta"?} -> {"key", ...}
    GET  /admin/executions            -> {"executions": [summary, ...]}
    GET  /admin/executions/{id}       -> summary (nodes, tokens, status)
    POST /admin/executions/{id}/close {"status"?, "meta"?} -> summary; writes the tree
    GET  /admin/routes                -> {"routes", "engines", "draining"}
    PUT  /admin/routes/{id}           {"engine_id"}: route an execution to an engine
    POST /admin/engines               {"engine_id", "url"}: add (or replace) an engine
    POST /admin/engines/{id}/drain    {"draining": true|false}: stop/resume new calls there
    GET  /metrics                     -> Prometheus text format (`ProxyMetrics`)

Requests carry `Authorization: Bearer <admin token>`; errors use OpenAI's error shape.
The coordinator in the same process uses the `ProxyApp` Python methods instead; the
handlers reach that app only through `AdminTarget`, the part of it they call.

`/metrics` (scrape it with `authorization: {credentials_file: <admin token file>}` in the
Prometheus job) reports HTTP requests and errors by handler and status with latency
histograms (counted as each request finishes, `MeteredApplication`), and, from the trees
at scrape time, recorded model calls by role / engine / finish reason, their engine time,
tokens, context lengths and reroutes (extra engine attempts), plus open executions and
engines, and constrained calls rescored by outcome (`gyre.proxy.rescore`). Names and labels:
docs/tracking.md.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import re
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import tornado.web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from gyre.proxy import rescore
from gyre.proxy.conversation import check_type, need, opt
from gyre.proxy.errors import ApiError, invalid
from gyre.proxy.handlers import JsonErrorHandler, bearer_key
from gyre.proxy.jsonbody import decode_body
from gyre.proxy.session import Execution

if TYPE_CHECKING:
    from gyre.proxy.routing import EngineLike
    from gyre.proxy.service import ProxyService
    from gyre.trajectory.tree import TrajectoryTree

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKENS = (256, 1024, 4096, 16384, 65536, 131072, 262144, 524288, 1048576)


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


class AdminTarget(Protocol):
    """What the admin routes operate on: `gyre.proxy.app.ProxyApp`'s Python API."""

    service: ProxyService
    admin_token: str
    metrics: ProxyMetrics

    def register_execution(
        self, execution_id: str, role: str | None = None, meta: Mapping[str, Any] | None = None
    ) -> str: ...

    def close_execution(
        self, execution_id: str, status: str = "completed", meta: Mapping[str, Any] | None = None
    ) -> TrajectoryTree: ...

    def set_route(self, execution_id: str, engine_id: str) -> None: ...

    def set_draining(self, engine_id: str, draining: bool = True) -> None: ...

    def add_engine(self, engine_id: str, engine: str | EngineLike) -> None: ...


class AdminHandler(JsonErrorHandler):
    api = "openai"

    def initialize(self, service: Any = None, app: AdminTarget | None = None) -> None:  # type: ignore[override]
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
        body = decode_body(self.request.body or b"{}")
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
            status = opt(body, "status", str, "body")
            status = "completed" if status is None else status
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
            if not ENGINE_RE.fullmatch(engine_id):
                raise invalid(f"body.engine_id: {engine_id!r}; allowed: 1-128 of {ID_CHARS}")
            url = _engine_url(need(body, "url", str, "body"))
            self.app.add_engine(engine_id, url)
            return {"engine_id": engine_id, "url": url}

        self._handle(add)


def _engine_url(url: str) -> str:
    """An engine's base URL: http(s)://host[:port][/path], ASCII."""
    try:
        parts = urllib.parse.urlsplit(url)
        ok = url.isascii() and parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError:
        ok = False
    if not ok:
        raise invalid(f"body.url: {url!r:.200}; allowed: an http:// or https:// URL", "url")
    return url


class DrainHandler(AdminHandler):
    def post(self, engine_id: str) -> None:
        def drain() -> dict[str, Any]:
            draining = opt(self.json_body(), "draining", bool, "body")
            draining = True if draining is None else draining
            self.app.set_draining(engine_id, draining)
            return {"engine_id": engine_id, "draining": draining}

        self._handle(drain)


class ProxyMetrics:
    """The proxy's Prometheus metrics in a registry of its own (no process-global state)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        by_code = ["handler", "code"]
        self.requests = Counter(
            "gyre_proxy_requests", "HTTP requests answered", by_code, registry=r
        )
        self.errors = Counter(
            "gyre_proxy_errors", "HTTP answers with status >= 400", by_code, registry=r
        )
        self.request_seconds = Histogram("gyre_proxy_request_seconds", "HTTP request latency",
                                         ["handler"], buckets=SECONDS, registry=r)  # fmt: skip
        by_call = ["role", "engine", "finish_reason"]
        self.calls = Counter("gyre_proxy_calls", "model calls recorded", by_call, registry=r)
        self.call_seconds = Histogram("gyre_proxy_call_seconds",
                                      "engine time per recorded call, reroute waits included",
                                      ["engine"], buckets=SECONDS, registry=r)  # fmt: skip
        self.tokens = Counter("gyre_proxy_tokens", "tokens of recorded calls (input: new input)",
                              ["kind"], registry=r)  # fmt: skip
        self.context_tokens = Histogram("gyre_proxy_context_tokens", "prompt tokens per call",
                                        buckets=TOKENS, registry=r)  # fmt: skip
        self.reroutes = Counter("gyre_proxy_reroutes",
                                "engine attempts that were aborted or failed and retried",
                                registry=r)  # fmt: skip
        self.executions = Gauge("gyre_proxy_executions", "registered executions", ["state"],
                                registry=r)  # fmt: skip
        self.engines = Gauge("gyre_proxy_engines", "known engines", ["state"], registry=r)
        self.rescores = Counter("gyre_proxy_rescores", "constrained calls whose grammar-masked "
                                "log-probs were rescored by a prefill (gyre.proxy.rescore), by "
                                "outcome", ["outcome"], registry=r)  # fmt: skip
        for outcome in rescore.OUTCOMES:
            self.rescores.labels(outcome)
        self._counted: dict[str, int] = {}  # execution id -> nodes already counted
        self._rescored: collections.Counter[str] = collections.Counter()  # counted so far

    def observe_request(self, handler: tornado.web.RequestHandler) -> None:
        """Count one finished HTTP request (called by `MeteredApplication`)."""
        name, code = type(handler).__name__, handler.get_status()
        self.requests.labels(name, str(code)).inc()
        if code >= 400:
            self.errors.labels(name, str(code)).inc()
        self.request_seconds.labels(name).observe(handler.request.request_time())

    def collect(self, service: ProxyService) -> None:
        """Count the calls recorded since the last scrape; set the execution / engine gauges."""
        open_ = 0
        for eid, ex in service.executions.items():
            open_ += not ex.closed
            tree, done = ex.tree, self._counted.get(eid, 0)
            for node_id in range(done + 1, len(tree) + 1):
                self._count_call(tree, node_id)
            self._counted[eid] = len(tree)
        self.executions.labels("open").set(open_)
        self.executions.labels("closed").set(
            len(service.executions) - open_ + len(service.forgotten)
        )
        for outcome, n in service.rescores.items():
            self.rescores.labels(outcome).inc(n - self._rescored[outcome])
            self._rescored[outcome] = n
        router = service.router
        self.engines.labels("draining").set(len(router.draining & set(router.engines)))
        self.engines.labels("live").set(len(set(router.engines) - router.draining))

    def forget(self, execution_id: str, tree: Any) -> None:
        """Count the calls of an execution the proxy drops that no scrape counted yet."""
        for node_id in range(self._counted.pop(execution_id, 0) + 1, len(tree) + 1):
            self._count_call(tree, node_id)

    def _count_call(self, tree: Any, node_id: int) -> None:
        node = tree.node(node_id)
        self.calls.labels(node.role, node.engine_id, node.finish_reason).inc()
        self.call_seconds.labels(node.engine_id).observe(max(0.0, node.t_end - node.t_start))
        self.tokens.labels("input").inc(len(node.input_ids))
        self.tokens.labels("output").inc(len(node.output_ids))
        self.context_tokens.observe(tree.path_length(node.parent_id) + len(node.input_ids))
        self.reroutes.inc(node.attempts - 1)

    def exposition(self, service: ProxyService, accept: str | None) -> tuple[bytes, str]:
        """(body, content type) for a scrape, in the format its Accept header asks for."""
        self.collect(service)
        try:
            encoder, content_type = choose_encoder(accept or "")
        except (TypeError, ValueError):  # an Accept header the library cannot parse
            encoder, content_type = choose_encoder("")  # the classic text format
        return encoder(self.registry), content_type


class MeteredApplication(tornado.web.Application):
    """Tornado's Application, counting every finished request in `metrics` before logging it."""

    def __init__(self, metrics: ProxyMetrics, *args: Any, **kwargs: Any) -> None:
        self.metrics = metrics
        super().__init__(*args, **kwargs)

    def log_request(self, handler: tornado.web.RequestHandler) -> None:
        self.metrics.observe_request(handler)
        super().log_request(handler)


class MetricsHandler(AdminHandler):
    def get(self) -> None:
        body, content_type = self.app.metrics.exposition(
            self.service, self.request.headers.get("Accept")
        )
        self.set_header("Content-Type", content_type)
        self.finish(body)


ID_CHARS = "A-Za-z0-9_.:@-"
ID = rf"([{ID_CHARS}]+)"
ENGINE_RE = re.compile(rf"[{ID_CHARS}]{{1,128}}")
ROUTES: list[tuple[str, type[AdminHandler]]] = [
    (r"/admin/executions", ExecutionsHandler),
    (rf"/admin/executions/{ID}", ExecutionHandler),
    (rf"/admin/executions/{ID}/close", CloseHandler),
    (r"/admin/routes", RoutesHandler),
    (rf"/admin/routes/{ID}", RouteHandler),
    (r"/admin/engines", EnginesHandler),
    (rf"/admin/engines/{ID}/drain", DrainHandler),
    (r"/metrics", MetricsHandler),
]
