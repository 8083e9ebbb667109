"""Tornado HTTP front of the embedded engine: SGLang's native routes over `Engine`.

Routes (SGLang 0.5.21's names, request bodies and preconditions; see docs/engine.md):

    POST /generate                  POST /abort_request          POST /pause_generation
    POST /v1/chat/completions       (OpenAI's chat completions, the subset `gyre.rollout.chat`
                                    serves: a judge's constrained verdicts)
    POST /continue_generation       GET|POST /flush_cache        GET /health
    GET  /model_info (weight_version; /get_model_info: SGLang's deprecated alias)
    POST /begin_weight_update       POST /update_weights_from_tensor  POST /end_weight_update
    POST /init_weights_update_group POST /update_weights_from_distributed
    POST /destroy_weights_update_group  (the update-group path: gyre.rollout.update_group)
    POST /release_memory_occupation POST /resume_memory_occupation
    GET|DELETE /gyre/requests       (Gyre only: log of received /generate calls)
    GET  /gyre/stats                (Gyre only: batch sizes, queue lengths)
    POST /gyre/kv/pin  POST /gyre/kv/import  POST /gyre/kv/release  GET /gyre/kv/segments/H
                                    (Gyre only: KV-cache migration, gyre.rollout.kvmigrate)

Errors become HTTP responses in one place (`BaseHandler.write_error`): `ProtocolError` →
400, `EngineConflict` (a release while calls run, a weight update outside a weight-update
session) → 409, `EngineUnavailable` → 503, anything else → 500, each with SGLang's error body
``{"object": "error", "message": ..., "type": ..., "code": ...}``. A /generate whose client
disconnects is aborted. Engine control calls block on a step boundary (and joining an
update group or receiving its broadcast blocks on the publisher), so they run on the default
executor and the IOLoop stays responsive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tornado.httpserver
import tornado.ioloop
import tornado.iostream
import tornado.netutil
import tornado.web

from gyre.errors import ConfigError, ProtocolError
from gyre.lifetime import until_signal
from gyre.rollout import chat, kvstore, update_group, weights
from gyre.rollout import engine as engine_mod
from gyre.rollout.protocol import (
    authorized,
    parse_generate,
    parse_kv_import,
    parse_kv_pin,
    parse_kv_release,
    parse_memory_tags,
    parse_pause_mode,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class Config:
    """Where the embedded engine listens, and the engine it runs."""

    host: str = "127.0.0.1"
    # interface to bind
    port: int = 30000
    # TCP port; 0 picks a free one (printed on stdout)
    engine: engine_mod.Config = field(default_factory=engine_mod.Config)
    # the engine behind the routes
    api_key: str | None = None
    # every route but /health needs `Authorization: Bearer <api_key>` (None: open)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: {self.port}; allowed: 0..65535")


class BaseHandler(tornado.web.RequestHandler):
    def initialize(self, engine: engine_mod.Engine, api_key: str | None = None) -> None:
        self.engine = engine
        self.api_key = api_key

    def prepare(self) -> None:
        if not authorized(
            self.request.path, self.request.headers.get("Authorization"), self.api_key
        ):
            self.send({"object": "error", "message": "Unauthorized: this engine takes its run's "
                       "engine key (Authorization: Bearer ...)", "type": "Unauthorized",
                       "code": 401}, 401)  # fmt: skip

    def json_body(self) -> Any:
        if not self.request.body:
            return {}
        try:
            return json.loads(self.request.body)
        except json.JSONDecodeError as e:
            raise ProtocolError(f"body: not valid JSON ({e})") from None

    def send(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj))

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await tornado.ioloop.IOLoop.current().run_in_executor(None, fn, *args)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ProtocolError):
            status_code, kind, message = 400, "BadRequest", str(exc)
        elif isinstance(exc, engine_mod.EngineConflict):
            status_code, kind, message = 409, "Conflict", str(exc)
        elif isinstance(exc, engine_mod.EngineUnavailable):
            status_code, kind, message = 503, "ServiceUnavailable", str(exc)
        elif isinstance(exc, tornado.web.HTTPError):
            kind, message = "HTTPError", exc.log_message or self._reason
        else:
            kind, message = "InternalServerError", f"{type(exc).__name__}: {exc}"
        self.set_status(status_code)
        self.send(
            {"object": "error", "message": message, "type": kind, "code": status_code}, status_code
        )

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(
            value, ProtocolError | engine_mod.EngineConflict | engine_mod.EngineUnavailable
        ):
            log.info("%s %s: %s", self.request.method, self.request.path, value)
        else:
            super().log_exception(typ, value, tb)


class GenerateHandler(BaseHandler):
    rid: str | None = None
    done = False

    async def post(self) -> None:
        req = parse_generate(self.json_body(), vocab_size=self.engine.vocab_size)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()

        def deliver(body: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(_resolve, future, body)

        self.rid = req.rid
        if req.sampling.constrained:  # compiling a new grammar may take a while
            await self.blocking(self.engine.submit, req, deliver)
        else:
            self.engine.submit(req, deliver)
        body = await future
        self.done = True
        try:
            self.send(body)
        except tornado.iostream.StreamClosedError:
            log.info("client of %s left before the answer", req.rid)

    def on_connection_close(self) -> None:
        if self.rid is not None and not self.done:
            tornado.ioloop.IOLoop.current().run_in_executor(
                None, self.engine.abort, self.rid, "client disconnected"
            )


class ChatCompletionsHandler(GenerateHandler):
    """OpenAI's chat completions over the same queue as /generate (`gyre.rollout.chat`)."""

    async def post(self) -> None:
        body = self.json_body()
        req = await self.blocking(chat.parse_chat, body, self.engine.tokenizer)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()

        def deliver(result: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(_resolve, future, result)

        self.rid = req.rid
        await self.blocking(self.engine.submit, req, deliver)
        result = await future
        self.done = True
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        try:
            self.send(chat.completion_body(result, model or self.engine.config.model))
        except tornado.iostream.StreamClosedError:
            log.info("client of %s left before the answer", req.rid)


def _resolve(future: asyncio.Future[dict[str, Any]], body: dict[str, Any]) -> None:
    if not future.done():
        future.set_result(body)


class AbortHandler(BaseHandler):
    async def post(self) -> None:
        body = self.json_body()
        if not isinstance(body, dict):
            raise ProtocolError("body: expected a JSON object")
        if body.get("abort_all"):
            n = await self.blocking(self.engine.abort, None, "aborted by abort_all")
        elif isinstance(body.get("rid"), str) and body["rid"]:
            n = await self.blocking(self.engine.abort, body["rid"], "aborted by request")
        else:
            raise ProtocolError('body: expected {"rid": "<id>"} or {"abort_all": true}')
        self.send({"success": True, "aborted": n})


class PauseHandler(BaseHandler):
    async def post(self) -> None:
        mode = parse_pause_mode(self.json_body())
        await self.blocking(self.engine.pause, mode)
        self.send({"message": "Generation paused successfully.", "status": "ok"})


class ContinueHandler(BaseHandler):
    def post(self) -> None:
        self.engine.resume()
        self.send({"message": "Generation continued successfully.", "status": "ok"})


class FlushCacheHandler(BaseHandler):
    async def get(self) -> None:
        await self.blocking(self.engine.flush_cache)
        self.send({"success": True, "message": "Cache flushed."})

    post = get


class HealthHandler(BaseHandler):
    def get(self) -> None:
        self.send({"status": "ok", "released": self.engine.released})


class ModelInfoHandler(BaseHandler):
    def get(self) -> None:
        e = self.engine
        self.send(
            {
                "model_path": e.config.model,
                "tokenizer_path": e.config.model,
                "is_generation": True,
                "weight_version": e.weight_version,
                "vocab_size": e.vocab_size,
                "eos_token_id": e.eos_id,
                "max_position_embeddings": e.max_positions,
            }
        )


class BeginUpdateHandler(BaseHandler):
    async def post(self) -> None:
        await self.blocking(self.engine.begin_weight_update)
        self.send({"success": True, "message": "Success"})


class EndUpdateHandler(BaseHandler):
    async def post(self) -> None:
        await self.blocking(self.engine.end_weight_update)
        self.send({"success": True, "message": "Success"})


class UpdateWeightsHandler(BaseHandler):
    async def post(self) -> None:
        # off the IOLoop: a bucket sent by handle is fetched from its publisher while decoded
        named, version, _flush = await self.blocking(weights.decode_update, self.json_body())
        new = await self.blocking(self.engine.update_weights, named, version)
        self.send(
            {"success": True, "message": f"Updated {len(named)} tensors; weight version {new}."}
        )


class InitGroupHandler(BaseHandler):
    async def post(self) -> None:
        group, rank_offset = update_group.parse_init(self.json_body())
        await self.blocking(self.engine.join_update_group, group, rank_offset)
        print(f"gyre engine: joined update group {group.group_name} at rank {rank_offset} of "
              f"{group.world_size}", file=sys.stderr, flush=True)  # fmt: skip
        self.send({"success": True, "message": "Succeeded to initialize custom process group."})


class DistributedUpdateHandler(BaseHandler):
    async def post(self) -> None:
        req = update_group.parse_update(self.json_body())
        new = await self.blocking(self.engine.update_weights_from_distributed, req)
        self.send({"success": True, "message": f"Updated {len(req.specs)} tensors from "
                   f"{req.group_name!r}; weight version {new}."})  # fmt: skip


class DestroyGroupHandler(BaseHandler):
    async def post(self) -> None:
        name = update_group.parse_destroy(self.json_body())
        await self.blocking(self.engine.leave_update_group, name)
        self.send({"success": True, "message": "Succeeded to destroy custom process group."})


def _all_memory(body: Any) -> None:
    """The embedded engine releases weights and KV cache together (it has no CUDA graphs)."""
    tags = parse_memory_tags(body)
    if tags and not {"weights", "kv_cache"} <= set(tags):
        raise ProtocolError(
            f"tags: {list(tags)}; the embedded engine releases weights and kv_cache together: "
            "allowed null, [] or both"
        )


class ReleaseHandler(BaseHandler):
    async def post(self) -> None:
        _all_memory(self.json_body())
        await self.blocking(self.engine.release_memory)
        self.send({"success": True})


class ResumeHandler(BaseHandler):
    async def post(self) -> None:
        _all_memory(self.json_body())
        await self.blocking(self.engine.resume_memory)
        self.send({"success": True})


class RequestLogHandler(BaseHandler):
    def get(self) -> None:
        rid = self.get_query_argument("rid", None)
        log = self.engine.request_log()
        self.send({"requests": [r for r in log if rid is None or r["rid"] == rid]})

    def delete(self) -> None:
        self.send({"cleared": len(self.engine.request_log(clear=True))})


class StatsHandler(BaseHandler):
    def get(self) -> None:
        self.send(self.engine.stats())


class KVPinHandler(BaseHandler):
    async def post(self) -> None:
        req = parse_kv_pin(self.json_body())
        segments = await self.blocking(self.engine.pin_kv, req.rid_prefixes, req.rids, req.ttl_s)
        self.send({"segments": [s.to_json() for s in segments]})


class KVImportHandler(BaseHandler):
    async def post(self) -> None:
        req = parse_kv_import(self.json_body())
        imported, failed = await self.blocking(
            self.engine.receive_kv, req.source, req.segments, req.transport
        )
        self.send({"imported": imported, "failed": failed})


class KVReleaseHandler(BaseHandler):
    async def post(self) -> None:
        handles = parse_kv_release(self.json_body())
        self.send({"released": await self.blocking(self.engine.release_kv, handles)})


class KVSegmentHandler(BaseHandler):
    async def get(self, handle: str) -> None:
        buf = self.engine.pinned_buffer(handle)
        if buf is None:
            raise tornado.web.HTTPError(
                404, "no pinned KV segment %s (released or expired)", handle
            )
        self.set_header("Content-Type", "application/octet-stream")
        self.set_header("Content-Length", str(buf.nbytes))
        view = buf.data
        for start in range(0, buf.nbytes, kvstore.HTTP_CHUNK):
            self.write(bytes(view[start : start + kvstore.HTTP_CHUNK]))
            await self.flush()
        self.finish()


ROUTES: list[tuple[str, type[BaseHandler]]] = [
    ("/generate", GenerateHandler),
    ("/v1/chat/completions", ChatCompletionsHandler),
    ("/abort_request", AbortHandler),
    ("/pause_generation", PauseHandler),
    ("/continue_generation", ContinueHandler),
    ("/flush_cache", FlushCacheHandler),
    ("/health", HealthHandler),
    ("/model_info", ModelInfoHandler),
    ("/get_model_info", ModelInfoHandler),
    ("/begin_weight_update", BeginUpdateHandler),
    ("/update_weights_from_tensor", UpdateWeightsHandler),
    ("/end_weight_update", EndUpdateHandler),
    ("/init_weights_update_group", InitGroupHandler),
    ("/update_weights_from_distributed", DistributedUpdateHandler),
    ("/destroy_weights_update_group", DestroyGroupHandler),
    ("/release_memory_occupation", ReleaseHandler),
    ("/resume_memory_occupation", ResumeHandler),
    ("/gyre/requests", RequestLogHandler),
    ("/gyre/stats", StatsHandler),
    ("/gyre/kv/pin", KVPinHandler),
    ("/gyre/kv/import", KVImportHandler),
    ("/gyre/kv/release", KVReleaseHandler),
    (r"/gyre/kv/segments/([0-9a-f]+)", KVSegmentHandler),
]


def make_app(engine: engine_mod.Engine, api_key: str | None = None) -> tornado.web.Application:
    return tornado.web.Application(
        [(path, h, {"engine": engine, "api_key": api_key}) for path, h in ROUTES]
    )


async def serve(
    config: Config,
    load: Callable[[engine_mod.Config], engine_mod.Engine] = engine_mod.Engine.load,
) -> None:
    """Load the model (`load`, in an executor thread), listen, print the URL on stdout,
    serve until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(None, load, config.engine)
    engine.start()
    # weight payloads (base64 pickles of the tensors) can be large: allow up to 4 GiB bodies
    server = tornado.httpserver.HTTPServer(
        make_app(engine, config.api_key), max_body_size=1 << 32, max_buffer_size=1 << 32
    )
    sockets = tornado.netutil.bind_sockets(config.port, config.host)
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    print(f"gyre engine listening on http://{config.host}:{port}", flush=True)
    print(f"gyre engine listening on http://{config.host}:{port}", file=sys.stderr, flush=True)
    try:
        await until_signal()
    finally:
        server.stop()
        await loop.run_in_executor(None, engine.stop)
        print("gyre engine stopped", file=sys.stderr, flush=True)


def preload() -> None:
    """Import what an engine imports on its way to serving (this module: torch, tornado, the
    engine; transformers' model code): what an engine zygote holds before it forks engines
    (`gyre.zygote`)."""
    import transformers

    for name in ("AutoModelForCausalLM", "AutoTokenizer", "PreTrainedTokenizerFast",
                 "Qwen2Config", "Qwen2ForCausalLM", "DynamicCache"):  # fmt: skip
        getattr(transformers, name)  # transformers imports its modules on first use
