"""The run's harness side, as the proxy node runs it and the preflight checks it: the adapter
and its program, the sandbox, the task suite and the tasks groups are drawn from.

`load_tasks` is the run's one load of its suite (the proxy node's `ExecutionHost`, `gyre
eval`); `check_adapter` and `check_sandbox` refuse, in one line, an adapter, program or
sandbox the harness pool would trip over. `check` is the preflight's `Check` of this domain
(`gyre.runtime.shared.checks`): each of them as far as the place it runs can see.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gyre.errors import ConfigError
from gyre.runtime.shared.checks import RUNS_HERE, Site, Where, elsewhere

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig
    from gyre.tasks import TaskSuite
    from gyre.tasks.suite import Task


def load_tasks(cfg: RunConfig) -> tuple[TaskSuite, list[str]]:
    """The suite and the task names groups are drawn from (checked against the suite)."""
    from gyre.tasks.suite import named_suite

    suite = named_suite(cfg.harness.suite)
    if cfg.harness.tool_latency is not None:
        latency = cfg.harness.tool_latency
        tasks = tuple(dataclasses.replace(t, tool_latency=latency) for t in suite.tasks)
        suite = dataclasses.replace(suite, tasks=tasks)
    names = cfg.harness.tasks or suite.names()
    unknown = [n for n in names if n not in suite.names()]
    if unknown:
        raise ConfigError(
            f"harness.tasks: {unknown} not in suite {cfg.harness.suite!r}; allowed: "
            f"{', '.join(suite.names())}"
        )
    return suite, names


def check_adapter(cfg: RunConfig, *, program: bool) -> None:
    """The adapter is known and its params valid; with `program`, its program is installed."""
    try:
        adapter = cfg.harness.adapter_object()
    except ConfigError as exc:
        raise ConfigError(f"harness.{exc}") from None
    path = os.environ.get("PATH", os.defpath)
    if program and adapter.resolve_program(path) is None:
        hint = f"; install it with {adapter.install}" if adapter.install else ""
        raise ConfigError(
            f"harness.adapter: {cfg.harness.adapter!r} needs the program "
            f"{adapter.command[0]!r}, which is not on PATH or in {adapter.search_path}{hint}"
        )
    try:
        adapter.check_params(cfg.harness.adapter_params)
    except ConfigError as exc:
        raise ConfigError(f"harness.{exc}") from None


def check_sandbox(sandbox: str, image: str) -> None:
    """Refuse (one line: what is missing, what is allowed) a sandbox that cannot run here."""
    from gyre.harness.sandbox import apptainer_works, bwrap_works

    if sandbox == "none":
        return
    why = apptainer_works(image) if sandbox == "apptainer" else bwrap_works()
    if why is None:
        return
    need = ("Apptainer with harness.apptainer_image a local image" if sandbox == "apptainer"
            else "a working bubblewrap")  # fmt: skip
    other = "harness.sandbox=bwrap" if sandbox == "apptainer" else "harness.sandbox=apptainer"
    raise ConfigError(
        f"harness.sandbox: {sandbox}: {why}; allowed: {need}, {other}, or harness.sandbox=none "
        "to run harnesses unconfined (they can then read and rewrite checkers: docs/harness.md)"
    )


def check(cfg: RunConfig, site: Site) -> list[str]:
    """The preflight of the harness: the adapter and its params everywhere; its program where
    the job runs (a note on the login node, not checked by `render`); the sandbox on this
    machine (on a cluster the proxy node checks it as it starts); the suite and its tasks (a
    suite path missing here is a note from `render`, an error from the others)."""
    notes = _program(cfg, site.where)
    if site.where is Where.HERE:
        check_sandbox(cfg.harness.sandbox, cfg.harness.apptainer_image)
    return notes + _suite(cfg, site.where)


def _program(cfg: RunConfig, where: Where) -> list[str]:
    """The adapter's check; its program may be installed on the compute nodes only."""
    if where in RUNS_HERE:
        check_adapter(cfg, program=True)
        return []
    check_adapter(cfg, program=False)
    try:
        check_adapter(cfg, program=True)
    except ConfigError as e:
        if where is Where.CLUSTER:
            return [f"not checked here: {e} (the job's first step checks it)"]
    return []


def _suite(cfg: RunConfig, where: Where) -> list[str]:
    """The suite loads and holds every task of `harness.tasks`; a task scored by a judge has
    one to ask (`judge_served`)."""
    try:
        suite, names = load_tasks(cfg)
    except ConfigError as e:
        if where is Where.ANYWHERE and elsewhere(cfg.harness.suite):
            return [f"not checked here: harness.suite {cfg.harness.suite} (not on this "
                    "machine; gyre render --check, gyre submit and the job's first step "
                    "check it)"]  # fmt: skip
        if str(e).startswith("harness."):  # harness.tasks: names not in the suite
            raise
        raise ConfigError(f"harness.suite: {e}; point it at your task suite (docs/tasks.md), "
                          "e.g. harness.suite=/path/to/suite") from None  # fmt: skip
    judge_served(cfg, [suite[n] for n in names])
    return []


def judge_served(cfg: RunConfig, tasks: Sequence[Task]) -> None:
    """Refuse a run whose tasks are scored by the judge rule with no judge to ask: a task
    names no `scoring.judge.endpoint` and the job has no judge engine."""
    if cfg.topology.judge_engines:
        return
    unserved = [t.name for t in tasks if t.scoring.rule == "judge" and not t.scoring.judge.endpoint]
    if unserved:
        raise ConfigError(
            f"topology.judge_engines: 0, but task {unserved[0]!r} is scored by a judge with no "
            "scoring.judge.endpoint; allowed: topology.judge_engines >= 1 (engines in the job "
            "serve the judge) or a scoring.judge.endpoint in the task"
        )
