"""Test helper: run an embedded engine in a subprocess for the duration of a `with` block.

    with running_engine("tiny") as base_url:
        client = EngineClient(base_url)
        ...

The engine is an `EngineProcess` (the one that starts every engine): it binds a free port
chosen by the OS (``--port 0``), the helper waits for the URL it prints and for /health,
and on exit stops it (SIGTERM, then SIGKILL after a grace period). The engine's output goes
to a temp file whose tail is included in the error if the engine fails to start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gyre.rollout.protocol import ENGINE_KEY_ENV
from gyre.rollout.serving.config import ServerConfig
from gyre.rollout.serving.process import EngineProcess


@contextmanager
def running_engine(
    model: str = "tiny",
    *,
    threads: int = 1,
    max_batch_size: int = 32,
    weight_version: str = "0",
    prefix_cache_mb: int = 512,
    startup_timeout: float = 120.0,
    extra_args: tuple[str, ...] = (),
    api_key: str | None = None,
) -> Iterator[str]:
    """Start `gyre engine --model MODEL --port 0` and yield its base URL. `api_key`: the
    engine key it takes (default: this process's `GYRE_ENGINE_KEY`, if any)."""
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    if api_key:
        env[ENGINE_KEY_ENV] = api_key
    config = ServerConfig(
        model_path=model, launch="embedded", weight_version=weight_version, env=env,
        startup_timeout=startup_timeout, extra_args=[
            "--threads", str(threads), "--max-batch-size", str(max_batch_size),
            "--prefix-cache-mb", str(prefix_cache_mb), *extra_args,
        ],
    )  # fmt: skip
    engine = EngineProcess(config)
    try:
        yield engine.start()
    finally:
        engine.stop(grace=10)
