"""The `gyre` command line: one subcommand per user-facing entry point.

Each subcommand lives beside the code it drives, in a light module (no torch import at
top level) that exposes `register(subparsers)`; `register` adds its parser and sets
`func(args) -> int`. `main` only parses and dispatches; `gyre.errors.exit_status` turns
`GyreError` into exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gyre import __version__
from gyre.cliargs import Parser
from gyre.errors import exit_status

# subcommand name -> module that registers it
COMMANDS: dict[str, str] = {
    "engine": "gyre.rollout.cli",
    "proxy": "gyre.proxy.cli",
    "trace": "gyre.trajectory.cli",
    "plan": "gyre.runtime.cli",
    "sim": "gyre.sim.cli",
    "run": "gyre.runtime.cli",
    "eval": "gyre.runtime.cli",
    "report": "gyre.runtime.cli",
    "render": "gyre.launch.cli",
    "submit": "gyre.launch.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gyre", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gyre {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:  # a bad argument, --help, --version: their status, returned (also to in-process callers)
        args, extra = parser.parse_known_args(argv)
        if extra:  # `gyre run CONFIG --steps 2 train.lr=3e-4`: overrides may follow options too
            if not hasattr(args, "overrides") or any(_not_override(x) for x in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*args.overrides, *extra]
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return exit_status(f"gyre {args.command}", lambda: args.func(args))


def _not_override(arg: str) -> bool:
    key = arg.partition("=")[0]
    return (
        "=" not in arg or arg.startswith("-") or not key.replace(".", "").replace("_", "").isalnum()
    )


if __name__ == "__main__":
    sys.exit(main())
