"""Test helper: a `ProxyApp` serving on its own IOLoop in a background thread.

    with running_proxy({"e0": engine_url}, tokenizer=tiny_tokenizer()) as proxy:
        key = proxy.call(proxy.app.register_execution, "ex-1")
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key)
        ...
        tree = proxy.call(proxy.app.tree, "ex-1")

`call(fn, *args)` runs `fn` on the proxy's loop thread (the app is not thread-safe) and
returns its result. On exit the server and the loop are stopped and the thread joined.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from gyre.proxy.app import ProxyApp
from gyre.proxy.config import Config

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


@contextmanager
def running_proxy(
    engines: Mapping[str, Any],
    *,
    tokenizer: Any,
    config: Config | None = None,
    store: Any = None,
    admin_token: str | None = None,
) -> Iterator[RunningProxy]:
    """Serve a ProxyApp on 127.0.0.1:<free port> for the duration of the block."""
    token = admin_token or secrets.token_urlsafe(16)
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            app = ProxyApp(
                config or Config(),
                tokenizer=tokenizer,
                engines=engines,
                admin_token=token,
                store=store,
            )
            started["app"], started["port"] = app, app.listen(0)
        except BaseException as e:
            started["error"] = e
        ready.set()
        if "error" not in started:
            loop.run_forever()
        loop.close()

    thread = threading.Thread(target=main, name="gyre-proxy", daemon=True)
    thread.start()
    ready.wait(120)
    if "error" in started:
        thread.join()
        raise started["error"]
    app = started["app"]
    try:
        yield RunningProxy(
            app=app, url=f"http://127.0.0.1:{started['port']}", admin_token=token, loop=loop
        )
    finally:
        loop.call_soon_threadsafe(app.stop)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
