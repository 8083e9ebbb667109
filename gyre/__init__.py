"""Gyre: elastic online reinforcement learning for xLong-horizon LLM agents.

Gyre trains agents through unmodified black-box harnesses (Claude Code, the reference
agent, ...). Two planes cooperate: the elastic scheduling plane (`gyre.schedule`, driven by
the coordinator in `gyre.runtime` and by the simulator in `gyre.sim`) moves cells between
rollout and training, and the trajectory plane (`gyre.proxy`, `gyre.trajectory`,
`gyre.train`) records every model call token-in/token-out and turns executions into
training data. See README.md and docs/ for the map.
"""

import functools

__version__ = "0.1.0"


@functools.cache
def provenance() -> dict[str, str | None]:
    """Which Gyre wrote a run's files: the version and, from a git checkout, the commit (with
    `+dirty` when the checkout has local changes); recorded in the trace and model cards."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    commit: str | None = None
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "describe", "--always",
                                  "--dirty=+dirty", "--abbrev=40", "--match=NONE"],
                                 capture_output=True, text=True, timeout=5)  # fmt: skip
            commit = (out.stdout.strip() or None) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {"gyre_version": __version__, "git_commit": commit}
