"""Test helper: a `ProxyApp` serving on its own IOLoop in a background thread.

    with running_proxy({"e0": engine_url}, tokenizer=tiny_tokenizer()) as proxy:
        key = proxy.call(proxy.app.register_execution, "ex-1")
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key)
        ...
        tree = proxy.call(proxy.app.tree, "ex-1")

`call(fn, *args)` runs `fn` on the proxy's loop thread (the app is not thread-safe) and
returns its result; `admin(path, body)` POSTs to an admin route over HTTP with the admin
token. On exit the server and the loop are stopped and the thread joined.

`ScriptedEngine` is an engine for harness tests that need a policy which follows a script
(a random tiny model never finishes a task): it answers each call with the next scripted
text, tokenized with the real tokenizer, and keeps what it received like the embedded
engine's request log, so a test can check every node's path against it.

`StubEngine` (`running_stub_engine`) is an engine over HTTP that speaks the real /generate
protocol but runs no model: it answers after a fixed latency (or holds calls), for load and
shutdown tests and `tools/bench_proxy.py`, where a model's own cost would hide the proxy's.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
import tornado.httpserver
import tornado.netutil
import tornado.web

from gyre.proxy.app import ProxyApp
from gyre.proxy.config import Config
from gyre.rollout.protocol import GenerateResult, SamplingParams, ScoreResult

T = TypeVar("T")


@dataclass
class RunningProxy:
    """Handle on a proxy running in a background thread."""

    app: ProxyApp
    url: str
    admin_token: str
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the proxy's loop thread and return its result."""

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=60)

    def run(self, coro: Any, timeout: float = 600) -> Any:
        """Run a coroutine on the proxy's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def admin(self, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to an admin route over HTTP, with the admin token; its JSON answer."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.admin_token}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)


class ScriptedEngine:
    """An in-process engine (`EngineLike`) answering calls with scripted texts in order."""

    def __init__(self, tokenizer: Any, replies: list[str], *, then: str = "Done.") -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.then = then  # the answer once the script is used up
        self.requests: dict[str, list[int]] = {}  # rid -> input ids received

    async def generate(
        self, input_ids: Any, sampling: SamplingParams, rid: str, routed_from: int | None = None
    ) -> GenerateResult:  # a dense model's: no routed experts
        self.requests[rid] = np.asarray(input_ids).tolist()
        text = self.replies.pop(0) if self.replies else self.then
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        eos = int(self.tokenizer.eos_token_id)
        finish = "stop"
        if len(ids) >= sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        else:
            ids = [*ids, eos]
        return GenerateResult(
            rid=rid,
            output_ids=ids,
            output_logprobs=[-1.0] * len(ids),
            finish_type=finish,
            matched=eos if finish == "stop" else None,
            prompt_tokens=len(self.requests[rid]),
            completion_tokens=len(ids),
            weight_version="0",
            text=text,
        )

    async def score(self, input_ids: Any, start: int, rid: str) -> ScoreResult:
        """Scripted log-probs are -1.0 whatever the weights; a rescore finds them again."""
        return ScoreResult(logprobs=[-1.0] * (len(input_ids) - start), weight_version="0")


@contextmanager
def running_proxy(
    engines: Mapping[str, Any],
    *,
    tokenizer: Any,
    config: Config | None = None,
    store: Any = None,
    admin_token: str | None = None,
) -> Iterator[RunningProxy]:
    """Serve a ProxyApp on 127.0.0.1:<free port> for the duration of the block; on exit
    `ProxyApp.stop` (calls in flight get the retryable 503 / 529), then the loop ends."""
    token = admin_token or secrets.token_urlsafe(16)

    def start() -> tuple[ProxyApp, int]:
        app = ProxyApp(
            config or Config(), tokenizer=tokenizer, engines=engines, admin_token=token,
            store=store,
        )  # fmt: skip
        return app, app.listen(0)

    with _serving(start, "gyre-proxy") as (loop, (app, port)):
        try:
            yield RunningProxy(
                app=app, url=f"http://127.0.0.1:{port}", admin_token=token, loop=loop
            )
        finally:
            loop.call_soon_threadsafe(app.stop)


class StubEngine:
    """An engine speaking SGLang's /generate protocol over HTTP (what `EngineClient` sends)
    that runs no model: it answers every call with `reply_ids` + EOS after `latency_s`, for
    load and shutdown tests and `tools/bench_proxy.py`, where a model's own cost would hide
    the proxy's. `latency_s=None` holds every call until its client hangs up; `release_at=N`
    holds calls until N are in flight at once (then the latency runs). Counts calls, those in
    flight, the most in flight at once, and those whose client hung up first (also at
    GET /stub/stats); with `keep_inputs` it keeps each call's input ids by rid."""

    def __init__(
        self,
        eos_id: int,
        *,
        latency_s: float | None = 0.0,
        release_at: int | None = None,
        reply_ids: tuple[int, ...] = (300,),
        keep_inputs: bool = False,
    ) -> None:
        self.eos_id, self.latency_s, self.release_at = eos_id, latency_s, release_at
        self.reply = [*reply_ids, eos_id]
        self.calls = self.in_flight = self.peak = self.dropped = 0
        self.released_at: float | None = None  # unix time the held calls were let go
        self.requests: dict[str, list[int]] | None = {} if keep_inputs else None
        self._release: asyncio.Event | None = None

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "in_flight": self.in_flight, "peak": self.peak,
                "dropped": self.dropped, "released_at": self.released_at}  # fmt: skip

    async def hold(self, gone: asyncio.Event) -> bool:
        """Wait as configured; False if the client hung up (`gone`) first."""
        if self.release_at is not None:
            if self._release is None:
                self._release = asyncio.Event()
            if self.in_flight >= self.release_at and not self._release.is_set():
                self.released_at = time.time()
                self._release.set()
            waits = [asyncio.ensure_future(e.wait()) for e in (gone, self._release)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        if gone.is_set():
            return False
        try:
            await asyncio.wait_for(gone.wait(), self.latency_s)
        except TimeoutError:
            return True
        return False

    def application(self) -> tornado.web.Application:
        stub = self

        class Generate(tornado.web.RequestHandler):
            def initialize(self) -> None:
                self.gone = asyncio.Event()  # the client closed the connection

            def on_connection_close(self) -> None:
                self.gone.set()

            async def post(self) -> None:
                body = orjson.loads(self.request.body)
                if stub.requests is not None:
                    stub.requests[str(body.get("rid"))] = list(body["input_ids"])
                stub.calls += 1
                stub.in_flight += 1
                stub.peak = max(stub.peak, stub.in_flight)
                try:
                    answer = await stub.hold(self.gone)
                finally:
                    stub.in_flight -= 1
                if answer:
                    self.finish(orjson.dumps(stub.answer(body)))
                else:
                    stub.dropped += 1

        class Info(tornado.web.RequestHandler):
            def get(self) -> None:
                self.finish({"model_path": "tiny"})

        class Stats(tornado.web.RequestHandler):
            def get(self) -> None:
                self.finish(stub.stats())

        class Health(tornado.web.RequestHandler):
            def get(self) -> None:
                self.finish("ok")

        return tornado.web.Application(
            [("/generate", Generate), ("/get_model_info", Info), ("/stub/stats", Stats),
             ("/health", Health)]
        )  # fmt: skip

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /generate response body for one request body."""
        meta = {
            "id": body.get("rid"),
            "finish_reason": {"type": "stop", "matched": self.eos_id},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(self.reply),
            "weight_version": "0",
            "output_token_logprobs": [[-1.0, t, None] for t in self.reply],
        }
        return {"text": "ok", "output_ids": self.reply, "meta_info": meta}

    def listen(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve on the running loop; returns the bound port."""
        self.server = tornado.httpserver.HTTPServer(self.application())
        sockets = tornado.netutil.bind_sockets(port, host, backlog=4096)
        self.server.add_sockets(sockets)
        return int(sockets[0].getsockname()[1])


@contextmanager
def running_stub_engine(eos_id: int, **options: Any) -> Iterator[tuple[str, StubEngine]]:
    """A `StubEngine(eos_id, **options)` on its own loop thread: yields (base URL, stub)."""
    stub = StubEngine(eos_id, **options)
    with _serving(lambda: stub.listen(0), "gyre-stub-engine") as (loop, port):
        try:
            yield f"http://127.0.0.1:{port}", stub
        finally:
            loop.call_soon_threadsafe(stub.server.stop)


# -- load: many executions, each with one open call ---------------------------------------------

LOAD_PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
              "responses": "/v1/responses"}  # fmt: skip
LOAD_APIS = tuple(LOAD_PATHS)


@dataclass(frozen=True, slots=True)
class Answered:
    """One call of `open_calls`: its API, HTTP status, latency, when it was sent and answered."""

    api: str
    status: int
    latency_s: float
    sent_at: float  # unix time
    done_at: float  # unix time


def load_body(api: str, i: int, model: str, words: int) -> dict[str, Any]:
    """Call i's request: a system prompt and one user message of `words` words."""
    text = f"call {i}: " + "word " * words
    if api == "anthropic":
        return {"model": model, "max_tokens": 4, "system": "Load test.",
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
    if api == "responses":
        return {"model": model, "max_output_tokens": 4, "instructions": "Load test.", "input": text}
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "system", "content": "Load test."},
                         {"role": "user", "content": text}]}  # fmt: skip


async def open_calls(
    url: str, keys: list[str], *, model: str, words: int = 40, timeout_s: float = 600
) -> list[Answered]:
    """One call per key, all at once (key i calls API i % 3), on one keep-alive connection
    each, opened before (`HEAD /`, as Claude Code probes), so the calls start together."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def probe() -> None:
            async with http.head(url + "/") as r:
                await r.read()

        await asyncio.gather(*(probe() for _ in keys))

        async def one(i: int, key: str) -> Answered:
            api = LOAD_APIS[i % len(LOAD_APIS)]
            headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
            data = orjson.dumps(load_body(api, i, model, words))
            sent, t0 = time.time(), time.perf_counter()
            async with http.post(url + LOAD_PATHS[api], data=data, headers=headers) as r:
                await r.read()
            return Answered(api, r.status, time.perf_counter() - t0, sent, time.time())

        return list(await asyncio.gather(*(one(i, k) for i, k in enumerate(keys))))


@contextmanager
def _serving(start: Callable[[], T], name: str) -> Iterator[tuple[asyncio.AbstractEventLoop, T]]:
    """Run `start()` on a new event loop in a thread, yield (loop, its result), and on exit
    stop the loop (after what the caller scheduled on it) and join the thread."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            started["value"] = start()
        except BaseException as e:
            started["error"] = e
        ready.set()
        if "error" not in started:
            loop.run_forever()
            _finish_tasks(loop)
        loop.close()

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    ready.wait(120)
    if "error" in started:
        thread.join()
        raise started["error"]
    try:
        yield loop, started["value"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def _finish_tasks(loop: asyncio.AbstractEventLoop, grace_s: float = 5.0) -> None:
    """Let what is still pending on a stopped loop end (closing engine connections, calls
    the stop answered), cancelling whatever outlives `grace_s`, as `asyncio.run` does."""
    pending = asyncio.all_tasks(loop)
    if pending:
        _, late = loop.run_until_complete(asyncio.wait(pending, timeout=grace_s))
        for task in late:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*late, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
