"""Where a job's start-up goes: seconds per phase and per rank, from `gyre run` to the first step.

`gyre run` passes its own start to the ranks (`environ()`: its process start and the moment
it spawns `mpiexec`, unix seconds). Every rank keeps a `StartupClock`; `mark(phase)` closes
the phase that just ended, so a rank's phases are contiguous and add up to the moment it
served. Each rank sends them to the coordinator once it serves (`messages.StartupTimes`); the
coordinator's `StartupProfile` adds its own phases (the wait for every rank, then the first
step: dispatch, rollout and training until the first update) and goes into the run summary
as `startup`. `gyre run --profile-startup` prints it as a table (`table`);
`tools/bench_startup.py` compares runs.

    clock = StartupClock()        # first thing in a rank: "gyre run" and "launch" are known
                                  # (and "rank zygote": the warm imports it was forked from)
    ...; clock.mark("imports")    # each phase closed where it ends
    link.send(clock.report(rank, "cell"), COORDINATOR_RANK)

Stamps are wall-clock (`time.time`): they are compared across processes. A job started
without `gyre run` (sbatch, submitit) has no stamps in its environment: each rank then
measures from its own process start, and the table has no "gyre run" phase.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gyre.zygote import ENTERED

START_ENV = "GYRE_START_T"
"""Unix seconds `gyre run`'s process started (its Python start and config checks included)."""
SPAWN_ENV = "GYRE_SPAWN_T"
"""Unix seconds `gyre run` spawned `mpiexec`."""


def process_start() -> float:
    """Unix seconds this process started (Linux `/proc`; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return time.time()
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def environ() -> dict[str, str]:
    """`gyre run`, just before it spawns the ranks: the stamps they measure from."""
    return {START_ENV: f"{process_start():.3f}", SPAWN_ENV: f"{time.time():.3f}"}


class StartupClock:
    """One rank's start-up: contiguous phases (seconds), each closed by `mark`."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        self.t0 = float(env.get(START_ENV) or process_start())
        self.last = self.t0
        self.phases: dict[str, float] = {}
        if SPAWN_ENV in env:
            self.mark("gyre run", float(env[SPAWN_ENV]))  # its imports and config checks
        if ENTERED in env:  # forked by gyre run's rank zygote: mpiexec, then the warm imports
            self.mark("launch", float(env[ENTERED]))
            self.mark("rank zygote", process_start())
        else:
            self.mark("launch", process_start())  # mpiexec (srun) and the interpreter's start

    def mark(self, phase: str, now: float | None = None) -> None:
        """Close `phase` at `now` (default: now); a phase marked again adds up."""
        now = time.time() if now is None else now
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = max(self.last, now)

    def report(self, rank: int, component: str) -> Any:
        """The rank's phases as the message it sends the coordinator."""
        from gyre.runtime.shared.messages import StartupTimes

        return StartupTimes(rank, component, dict(self.phases))


class StartupProfile:
    """The coordinator's view: every rank's phases, its own up to the first step."""

    def __init__(self, clock: StartupClock) -> None:
        self.clock = clock
        self.ranks: dict[int, tuple[str, dict[str, float]]] = {0: ("coordinator", clock.phases)}
        self.first_step_s: float | None = None

    def add(self, rank: int, component: str, phases: Mapping[str, float]) -> None:
        self.ranks[rank] = (component, dict(phases))

    def arrived(self, rank: int, phase: str) -> None:
        """A rank's readiness message arrived now: its last phase (e.g. the proxy's start,
        which the rank does not time itself) ends here."""
        if rank in self.ranks:
            phases = self.ranks[rank][1]
            phases[phase] = max(0.0, time.time() - self.clock.t0 - sum(phases.values()))

    def once(self, phase: str) -> None:
        """The coordinator's `phase` ends now, unless it ended before."""
        if phase not in self.clock.phases:
            self.clock.mark(phase)

    def first_step(self) -> None:
        """The job's first update is done (later calls change nothing)."""
        if self.first_step_s is None:
            self.once("first batch")  # its other groups, its passes, the update
            self.first_step_s = self.clock.last - self.clock.t0

    def summary(self) -> dict[str, Any]:
        """The summary's `startup`: `first_step_s` and per rank its phases (seconds)."""
        return {
            "first_step_s": self.first_step_s,
            "ranks": [{"rank": r, "component": c, "phases": dict(p)}
                      for r, (c, p) in sorted(self.ranks.items())],
        }  # fmt: skip


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    """Phases (rows) x ranks (columns) of one or more summaries' `startup`; with several
    runs each cell is min/median/max. The last rows: each rank's total, the first step."""
    first = runs[0]["ranks"]
    names = [f"{r['rank']} {_short(r['component'])}" for r in first]
    phases: list[str] = []
    for run in runs:
        for r in run["ranks"]:
            phases += [p for p in r["phases"] if p not in phases]

    def cell(values: list[float]) -> str:
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.2f}"
        return f"{min(values):.1f}/{statistics.median(values):.1f}/{max(values):.1f}"

    def column(rank: int, phase: str | None) -> str:
        values = []
        for run in runs:
            for r in run["ranks"]:
                if r["rank"] == rank and (phase is None or phase in r["phases"]):
                    values.append(sum(r["phases"].values()) if phase is None
                                  else r["phases"][phase])  # fmt: skip
        return cell(values)

    rows = [[p, *(column(r["rank"], p) for r in first)] for p in phases]
    rows.append(["total", *(column(r["rank"], None) for r in first)])
    steps = [run["first_step_s"] for run in runs if run.get("first_step_s") is not None]
    rows.append(["first step", cell(steps), *([""] * (len(first) - 1))])
    widths = [max(len(x) for x in col) for col in zip(["phase", *names], *rows)]
    lines = [["phase", *names], *rows]
    return "\n".join("  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                               for i, (x, w) in enumerate(zip(line, widths)))
                     for line in lines)  # fmt: skip


def _short(component: str) -> str:
    return {"coordinator": "coord", "standalone": "engine"}.get(component, component)
