"""Child processes that do not outlive the process that started them.

A SIGKILLed process cannot clean up: the engine a cell rank started, the harness the proxy
node started or a scorer would keep running, orphaned, holding memory, ports and CPU. Every
such child is started through `setpriv --pdeathsig KILL` (util-linux, on every Debian or
Ubuntu machine): the kernel kills it as soon as its parent dies, however the parent died.

    argv = die_with_parent([sys.executable, "-m", "gyre.rollout.cli", ...])
"""

from __future__ import annotations

import shutil


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` prefixed so that the child gets SIGKILL when its parent dies (if setpriv exists).

    A program that cannot be found is left unwrapped, so starting it fails as it would
    have (an OSError naming it), not as a setpriv error.
    """
    setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
    if not setpriv or not argv or shutil.which(argv[0]) is None:
        return list(argv)
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]
