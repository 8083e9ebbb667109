"""`gyre engine`: start the embedded rollout engine (SGLang-compatible HTTP on CPU).

    gyre engine --model tiny --host 127.0.0.1 --port 30000 [--threads 1]

`--logprobs-under-grammar masked` is a test knob: the engine then reports constrained calls'
log-probs over the grammar-masked distribution, as SGLang does (docs/engine.md "Behaviour
log-probs"), so the proxy's correction of that can be tested on CPU.

Prints ``gyre engine listening on http://HOST:PORT`` on stdout once it serves (with
``--port 0`` the port is picked by the OS). Stops on SIGINT/SIGTERM. No torch import here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

from gyre import cliargs
from gyre.errors import exit_status

if TYPE_CHECKING:
    from gyre.rollout import server


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("engine", help="run the embedded rollout engine (SGLang protocol)")
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m | local HF model dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cliargs.port, default=30000, help="0 picks a free port")
    p.add_argument("--threads", type=cliargs.count, default=1, help="torch intra-op threads")
    p.add_argument("--max-batch-size", type=cliargs.count, default=32)
    p.add_argument("--weight-version", default="0")
    p.add_argument(
        "--prefix-cache-mb", type=cliargs.size, default=512, help="0 disables the prefix cache"
    )
    p.add_argument(
        "--kv-transport", default="auto", choices=("auto", "mooncake", "http"),
        help="how migrated KV moves between engines (auto: Mooncake if installed, else HTTP)",
    )  # fmt: skip
    p.add_argument(
        "--kv-host", default=None,
        help="address peers reach this engine's Mooncake Transfer Engine at (default: --host)",
    )  # fmt: skip
    p.add_argument(
        "--pace", default=None, metavar="JSON",
        help="paced engine: deliver each call at its modelled end (docs/pacing.md; a run's "
        "cells pass their run's `pace:` here)",
    )  # fmt: skip
    p.add_argument(
        "--logprobs-under-grammar", default="model", choices=("model", "masked"),
        help="test / emulation knob: log-probs reported for constrained calls, the model's own "
        "(model) or over the grammar-masked distribution as SGLang reports them (masked)",
    )  # fmt: skip
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gyre.rollout import server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    asyncio.run(server.serve(server_config(args)))
    return 0


def server_config(args: argparse.Namespace) -> server.Config:
    """The engine server's config from `gyre engine`'s arguments, with the run's engine key
    (`GYRE_ENGINE_KEY`): the CPU engine and the CUDA one (`gyre.gpu.engine`) both start
    from it."""
    from gyre.rollout import engine, server
    from gyre.rollout.protocol import engine_key

    return server.Config(
        host=args.host,
        port=args.port,
        api_key=engine_key(),
        engine=engine.Config(
            model=args.model,
            threads=args.threads,
            max_batch_size=args.max_batch_size,
            weight_version=args.weight_version,
            prefix_cache_mb=args.prefix_cache_mb,
            kv_transport=args.kv_transport,
            kv_host=args.kv_host or _reachable(args.host),
            pace=_pace(args.pace),
            logprobs_under_grammar=args.logprobs_under_grammar,
        ),
    )


def _pace(text: str | None) -> Any:
    if text is None:
        return None
    import json

    from gyre.config import load
    from gyre.errors import ConfigError
    from gyre.schedule.devices import EnginePace

    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--pace: not JSON ({e}); allowed: an object of EnginePace") from None
    return load(EnginePace, data, path="--pace")


def _reachable(host: str) -> str:
    """The address peers use for a server bound to `host` (all interfaces: this host's)."""
    if host in ("", "0.0.0.0", "::"):
        import socket

        return socket.gethostbyname(socket.gethostname())
    return host


def main(argv: list[str] | None = None) -> int:
    """`python -m gyre.rollout.cli ...`: the same command without the other subcommands."""
    parser = argparse.ArgumentParser(prog="gyre")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", *(argv if argv is not None else sys.argv[1:])])
    return exit_status("gyre engine", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
