"""The `gyre` command line: one subcommand per user-facing entry point.

Each subcommand lives beside the code it drives, in a light module (no torch import at
top level) that exposes `register(subparsers)`; `register` adds its parser and sets
`func(args) -> int`. `main` only parses, dispatches and turns `GyreError` into exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gyre import __version__
from gyre.errors import GyreError

# subcommand name -> module that registers it
COMMANDS: dict[str, str] = {
    "engine": "gyre.rollout.cli",
    "proxy": "gyre.proxy.cli",
    "trace": "gyre.trajectory.cli",
    "plan": "gyre.schedule.cli",
    "sim": "gyre.sim.cli",
    "run": "gyre.runtime.cli",
    "eval": "gyre.runtime.cli",
    "report": "gyre.runtime.cli",
    "render": "gyre.launch.cli",
    "submit": "gyre.launch.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gyre {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except GyreError as e:
        print(f"gyre {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
