"""The preflight's one interface to the domains it asks: a `Check` is a domain's name and the
function that checks a run config as far as the place it runs can see (`Site`).

Every way a run starts runs the same checks (`gyre.runtime.preflight`): `gyre run` on this
machine, `gyre render` anywhere, `gyre render --check` and `gyre submit` on the login node,
the job's first step inside the allocation. Each domain owns its check next to the code the
ranks run — the harness and its tasks (`gyre.runtime.shared.harness`), the ranks and GPUs
(`gyre.runtime.shared.placement`), the run directory (`gyre.runtime.shared.run_directory`) —
and decides by `Site.where` what is an error, a note or not checked at all. The preflight is
the list of them, run in order:

    def check(cfg: RunConfig, site: Site) -> list[str]:   # the notes; ConfigError: refused
        ...

    CHECKS = (Check("harness", harness.check), ...)      # gyre.runtime.preflight
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig


class Where(enum.Enum):
    HERE = "here"
    """`gyre run`: this machine starts every rank."""
    ANYWHERE = "anywhere"
    """`gyre render`: only what holds wherever the script is written."""
    CLUSTER = "cluster"
    """`gyre render --check`, `gyre submit`: the cluster's login node (its shared file system
    and Slurm; programs and models may live on the compute nodes only)."""
    JOB = "job"
    """The job's first step (`python -m gyre.launch.check`), inside the allocation."""


RUNS_HERE = (Where.HERE, Where.JOB)
"""Where the job itself runs: what it needs must be here."""


@dataclass(frozen=True, slots=True)
class Site:
    """Where a preflight runs, and the run it starts there."""

    where: Where
    run_dir: Path | None = None
    """The run directory the job will use (`gyre run`, the job's `GYRE_RUN_DIR`); None:
    not known yet (the job makes one under `runs_dir`)."""
    resume: bool = False
    """The run in `run_dir` is continued with its own config plus overrides (`--resume`)."""
    config: Path | None = None
    """The config file a new run was started from (its outputs stay apart from it)."""


@dataclass(frozen=True, slots=True)
class Check:
    """One domain's preflight: `run(cfg, site)` raises `ConfigError` (one line: what is wrong,
    what is allowed) at the first problem and returns the notes to print."""

    name: str
    run: Callable[[RunConfig, Site], list[str]]


def elsewhere(paths: str | list[str]) -> bool:
    """A path (or one of a list) that does not exist here (a cluster's shared file system)."""
    return any(
        os.sep in s and not os.path.exists(s)
        for s in ([paths] if isinstance(paths, str) else paths)
    )
