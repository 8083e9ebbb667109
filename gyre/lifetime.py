"""How long Gyre's processes live: children die with their parent, servers until a signal.

A SIGKILLed process cannot clean up: the engine a cell rank started, the harness the proxy
node started or a scorer would keep running, orphaned, holding memory, ports and CPU. Every
such child is started through `setpriv --pdeathsig KILL` (util-linux, on every Debian or
Ubuntu machine): the kernel kills it as soon as its parent dies, however the parent died.

    argv = die_with_parent([sys.executable, "-m", "gyre.rollout.cli", ...])

A server (`gyre engine`, its CUDA variant, `gyre proxy`) serves until SIGINT or SIGTERM,
then shuts down in its own `finally`:

    await until_signal()
"""

from __future__ import annotations

import shutil
import signal


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` prefixed so that the child gets SIGKILL when its parent dies (if setpriv exists).

    A program that cannot be found is left unwrapped, so starting it fails as it would
    have (an OSError naming it), not as a setpriv error.
    """
    setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
    if not setpriv or not argv or shutil.which(argv[0]) is None:
        return list(argv)
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]


async def until_signal() -> None:
    """Return once this process gets SIGINT or SIGTERM (handled on the running event loop,
    from now on: a second signal during the shutdown that follows is ignored)."""
    import asyncio  # here: the harnesses that import this module for `die_with_parent` need not

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
