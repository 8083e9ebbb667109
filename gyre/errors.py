"""Gyre's exception hierarchy.

Every error a user can cause derives from `GyreError`; each boundary (CLI exit code, HTTP
response, MPI control message) turns these into its own shape in exactly one place.
`assert` is kept for internal invariants only.

Every command-line entry point (`gyre`, `python -m gyre.rollout.cli`, `python -m
gyre.proxy.cli`, `python -m gyre.launch.check`) runs its work through `exit_status`:

    return exit_status("gyre engine", lambda: args.func(args))
    # GyreError -> "gyre engine: error: <message>" on stderr, exit code 2
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class GyreError(Exception):
    """Base class of all errors Gyre reports to users."""


class ConfigError(GyreError, ValueError):
    """A configuration value is missing, unknown or out of range.

    The message names the key path, the offending value and what is allowed.
    """


class ProtocolError(GyreError):
    """A peer (harness, engine, cell) sent something the protocol does not allow."""


class EngineError(GyreError):
    """A rollout engine failed or refused a request."""


class StoreError(GyreError):
    """The HDF5 trace store cannot be read or written as asked."""


class SchedulerError(GyreError):
    """An event is inconsistent with the scheduler's state."""


class TrainingError(GyreError, ValueError):
    """Training input is unusable (empty batch, missing reward, NaN log-probs, ...)."""


class HarnessError(GyreError):
    """A harness could not be prepared, started or supervised."""


def exit_status(prog: str, command: Callable[[], int | None]) -> int:
    """Run a command-line entry point's work and return its exit status.

    A `GyreError` becomes one line on stderr, ``PROG: error: MESSAGE``, and status 2 (no
    traceback: the message names what was wrong and what is allowed); Ctrl-C is 130; a
    reader that closed stdout (`gyre trace show ... | head`) is not an error: 141, silent.
    """
    try:
        status = int(command() or 0)
        sys.stdout.flush()  # inside: a reader gone before the buffered tail is a closed pipe too
        return status
    except GyreError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # later writes to stdout (interpreter exit) must not fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
