"""`gyre proxy`: run the harness-facing proxy in front of one or more rollout engines.

    gyre proxy --engine http://127.0.0.1:30000 [--engine e1=http://...] --port 8000 \\
        --store runs/try/trace.h5 --admin-token-file runs/try/admin.token [--model tiny]

Engines are `URL` (ids e0, e1, ... in order) or `ID=URL`. The tokenizer matching the
engine comes from `--model` (tiny | smollm2-135m | a local HF directory) or, if omitted,
from the first engine's /model_info. The admin token file is read, or created with a
fresh token. Prints ``gyre proxy listening on http://HOST:PORT`` on stdout once serving;
stops on SIGINT/SIGTERM (open executions stay in the store's journal, see `recover`).
No torch import at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from gyre import cliargs
from gyre.errors import ConfigError, EngineError, exit_status
from gyre.lifetime import until_signal


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("proxy", help="run the harness-facing proxy (OpenAI/Anthropic APIs)")
    p.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="[ID=]URL",
        help="a rollout engine (repeat for several)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cliargs.port, default=8000, help="0 picks a free port")
    p.add_argument("--store", default=None, help="HDF5 trace file to record into (new file)")
    p.add_argument("--admin-token-file", required=True, help="read, or created with a token")
    p.add_argument("--model", default=None, help="tokenizer: tiny | smollm2-135m | HF dir")
    p.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="model name(s) clients must send (default: gyre)",
    )
    p.add_argument("--config", default=None, help="YAML file with a `proxy:` section")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=run)


def parse_engines(specs: list[str]) -> dict[str, str]:
    """['URL', 'id=URL', ...] -> {engine_id: url}."""
    out: dict[str, str] = {}
    for i, spec in enumerate(specs):
        engine_id, sep, url = spec.partition("=")
        if not sep:
            engine_id, url = f"e{i}", spec
        if not url.startswith(("http://", "https://")) or not engine_id:
            raise ConfigError(f"--engine: {spec!r}; allowed: URL or ID=URL with http(s)://")
        if engine_id in out:
            raise ConfigError(f"--engine: duplicate engine id {engine_id!r}")
        out[engine_id] = url.rstrip("/")
    return out


def admin_token(path: str) -> str:
    """The token in `path`, or a new one written there (mode 600)."""
    p = Path(path)
    if p.exists():
        token = p.read_text().strip()
        if len(token) < 8:
            raise ConfigError(f"--admin-token-file: {path} holds a token shorter than 8 chars")
        return token
    token = secrets.token_urlsafe(24)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


async def model_info(engines: dict[str, str]) -> dict[str, Any] | str:
    """The first engine's /model_info, or why it gave none (one line)."""
    from gyre.rollout.client import EngineClient

    url = next(iter(engines.values()))
    client = EngineClient(url, timeout=30)
    try:
        info = await client.request("GET", "/model_info", None)
    except EngineError as e:
        return f"the first engine ({url}) did not answer /model_info: {e}"
    finally:
        client.close()
    return info if isinstance(info, dict) else f"the first engine ({url}) sent no /model_info"


def model_spec(args: argparse.Namespace, info: dict[str, Any] | str) -> str:
    if args.model:
        return str(args.model)
    if isinstance(info, str):
        raise ConfigError(f"{info}; start the engine first, or pass --model for the tokenizer")
    if not isinstance(info.get("model_path"), str):
        raise ConfigError(
            "--model not given and the first engine's /model_info did not "
            "name a model_path; pass --model"
        )
    return str(info["model_path"])


def load_tokenizer(spec: str) -> Any:
    """The tokenizer (with a tool-capable chat template) of a model spec."""
    from gyre.models import load_tokenizer as load

    return load(spec)


def build_config(args: argparse.Namespace, max_positions: Any = None) -> Any:
    """The `proxy:` section of --config, with --model-name and the engine's context length."""
    from gyre.config import load, load_yaml
    from gyre.proxy.config import Config

    config = load_yaml(Config, args.config, "proxy") if args.config else Config()
    data = _as_dict(config)
    if args.model_name:
        data["model_names"] = args.model_name
    if isinstance(max_positions, int) and 2 <= max_positions < config.max_context_tokens:
        data["max_context_tokens"] = max_positions  # the model's own limit is smaller
    return load(Config, data, "proxy")


def _as_dict(config: Any) -> dict[str, Any]:
    from gyre.config import to_dict

    return dict(to_dict(config))


async def serve(args: argparse.Namespace) -> None:
    from gyre.proxy.app import ProxyApp

    engines = parse_engines(args.engine)
    info = await model_info(engines)
    known = info if isinstance(info, dict) else {}
    config = build_config(args, known.get("max_position_embeddings"))
    tokenizer = load_tokenizer(model_spec(args, info))
    store = None
    if args.store:
        from gyre.trajectory.store import TraceWriter

        store = TraceWriter(args.store, run_meta={"proxy": _as_dict(config), "engines": engines})
    app = ProxyApp(
        config,
        tokenizer=tokenizer,
        engines=engines,
        admin_token=admin_token(args.admin_token_file),
        store=store,
    )
    port = app.listen(args.port, args.host)
    gc.freeze()  # start-up objects (tokenizer, modules) leave the collector's scans
    print(f"gyre proxy listening on http://{args.host}:{port}", flush=True)
    try:
        await until_signal()
    finally:
        app.stop()
        app.close_store()
        print("gyre proxy stopped", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m gyre.proxy.cli ...`: the same command without the other subcommands."""
    parser = argparse.ArgumentParser(prog="gyre")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["proxy", *(argv if argv is not None else sys.argv[1:])])
    return exit_status("gyre proxy", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
