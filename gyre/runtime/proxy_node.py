"""The proxy node (world rank 1): the proxy, the harness pool and the evaluator.

One asyncio/Tornado loop hosts the `ProxyApp` (harness-facing APIs, TITO recording, routes),
a `HarnessRunner` (one subprocess per execution, in its own workspace) and the `Evaluator`
(scores each preserved workspace after its execution ends). A thread receives the
coordinator's commands over MPI and hands them to the loop:

* engines {id: url} / lost id / drain id routes / undrain id / route {execution: engine};
* launch x id task engine: register the execution (its key), route it, run its harness;
* cancel id; stop.

For each execution the node reports, in this order, `terminated` (outcome, timings) and
`assessed` (the closed trajectory tree, the verdict and every assessment). A switch's
reroute: `drain` marks the source engine so the proxy starts no new call there and sets
the reserved destinations, then acks with `drained`; the cell aborts its calls afterwards,
and the router retries each aborted call at its execution's new route (one node, attempts
counted), so the harness never sees the switch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError
from gyre.harness import ExecutionSpec, HarnessRunner, Terminated
from gyre.proxy.app import ProxyApp
from gyre.runtime import wire
from gyre.runtime.config import RunConfig
from gyre.runtime.layout import COORDINATOR_RANK
from gyre.tasks import AssessmentLog, Evaluator, TaskSuite, builtin_suite, load_suite


def load_tasks(cfg: RunConfig) -> tuple[TaskSuite, list[str]]:
    """The suite and the task names groups are drawn from (checked against the suite)."""
    suite = builtin_suite() if cfg.harness.suite == "builtin" else load_suite(cfg.harness.suite)
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


def check_harness(cfg: RunConfig) -> None:
    """Fail fast (before any process starts) when the adapter or its program is missing."""
    adapter = cfg.harness.adapter_object()
    path = os.environ.get("PATH", os.defpath)
    if adapter.resolve_program(path) is None:
        hint = f"; install it with {adapter.install}" if adapter.install else ""
        raise ConfigError(
            f"harness.adapter: {cfg.harness.adapter!r} needs the program "
            f"{adapter.command[0]!r}, which is not on PATH or in {adapter.search_path}{hint}"
        )
    try:
        adapter.check_params(cfg.harness.params)
    except ConfigError as exc:
        raise ConfigError(f"harness.{exc}") from None
    load_tasks(cfg)


class ProxyNode:
    """Everything rank 1 runs, on one event loop."""

    def __init__(self, cfg: RunConfig, comm: Any, run_dir: Path) -> None:
        self.cfg, self.comm, self.run_dir = cfg, comm, run_dir
        self.suite, _ = load_tasks(cfg)
        self.adapter = cfg.harness.adapter_object()
        h = cfg.harness
        self.runner = HarnessRunner(
            HarnessRunner.Config(
                workspace_root=str(run_dir / "workspaces"),
                harness_timeout_s=h.harness_timeout_s,
                overall_timeout_s=h.overall_timeout_s,
                kill_grace_s=h.kill_grace_s,
                keep_env=["OMP_NUM_THREADS", "HF_HUB_OFFLINE"],
            )
        )
        self.evaluator = Evaluator(
            Evaluator.Config(max_attempts=h.eval_attempts), log=AssessmentLog()
        )
        self.tasks: set[asyncio.Task[None]] = set()
        self.app: ProxyApp | None = None
        self.url = ""

    async def serve(self) -> int:
        from gyre.models import load_tokenizer

        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, load_tokenizer, self.cfg.model)
        self.app = ProxyApp(
            self.cfg.proxy, tokenizer=tokenizer, engines={}, admin_token=secrets.token_hex(16)
        )
        self.url = f"http://127.0.0.1:{self.app.listen(0)}"
        gc.freeze()  # start-up objects (tokenizer, modules) leave the collector's scans
        inbox: asyncio.Queue[tuple] = asyncio.Queue()
        threading.Thread(target=self._receive, args=(loop, inbox), daemon=True).start()
        self._up(("proxy_ready", self.url))
        while True:
            msg = await inbox.get()
            if msg[0] == "stop":
                break
            self._handle(msg)
        status = int(msg[1])
        for eid in self.runner.running:
            self.runner.cancel(eid, "run stopped")
        for task in list(self.tasks):
            task.cancel()
        self.app.stop()
        return status

    def _receive(self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[tuple]) -> None:
        while True:  # polled, not a blocking recv: that busy-polls a core in MPICH
            msg = wire.poll(self.comm, COORDINATOR_RANK, wire.DOWN, timeout=60.0)
            if msg is None:
                continue
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg[0] == "stop":
                return

    def _up(self, msg: tuple) -> None:
        wire.send(self.comm, msg, COORDINATOR_RANK, wire.UP)

    # ------------------------------------------------------------------ commands

    def _handle(self, msg: tuple) -> None:
        app = self.app
        assert app is not None
        kind = msg[0]
        if kind == "engines":
            for engine_id, url in msg[1].items():
                app.add_engine(engine_id, url)
        elif kind == "drain":  # drain engine, routes, ack (a switch waits for the ack)
            app.set_draining(msg[1], True)
            for eid, dest in msg[2].items():
                app.set_route(eid, dest)
            if msg[3]:
                self._up(("drained", msg[1]))
        elif kind == "undrain":
            app.set_draining(msg[1], False)
        elif kind == "launch":
            _, x, eid, task_name, engine_id = msg
            task = asyncio.ensure_future(self._execute(x, eid, task_name, engine_id))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif kind == "cancel":
            for eid in msg[1]:
                self.runner.cancel(eid, "cancelled at the end of the run")
        else:
            raise wire.RuntimeFailure(f"proxy node: unknown command {kind!r}")

    async def _execute(self, x: int, eid: str, task_name: str, engine_id: str) -> None:
        """One execution: key, route, harness, close, score; reports terminated + assessed."""
        app = self.app
        assert app is not None
        task = self.suite[task_name]
        key = app.register_execution(eid, role="main", meta={"task": task_name})
        app.set_route(eid, engine_id)
        spec = ExecutionSpec(
            execution_id=eid, task=task, adapter=self.adapter, proxy_url=self.url,
            api_key=key, model=self.cfg.model_name, params=dict(self.cfg.harness.params),
        )  # fmt: skip
        term = await self.runner.run(spec)
        self._up(("terminated", x, term.outcome.value, term.t_launch, term.t, term.reason))
        tree = app.close_execution(eid, term.outcome.value)
        app.service.router.forget(eid)
        verdict = await self._assess(term, task)
        self._up(("assessed", x, tree, verdict, _errors(term)))

    async def _assess(self, term: Terminated, task: Any) -> dict[str, Any]:
        t0 = time.time()
        try:
            v = await self.evaluator.assess(term, task)
        except Exception as e:  # an evaluator bug must not stall the group: excluded
            return {"status": "excluded", "reward": None, "error": f"evaluator crashed: {e}",
                    "assessments": [], "t": t0}  # fmt: skip
        rows = [a.to_row() for a in self.evaluator.log.for_execution(term.execution_id)]
        return {"status": v.status, "reward": v.reward, "error": v.assessment.error,
                "assessments": rows, "t": time.time()}  # fmt: skip


def _errors(term: Terminated) -> int:
    """Harness-side errors: a harness that failed (non-zero exit: it gave up on an API error)."""
    return 1 if term.outcome.value == "failed" else 0


def run_proxy_node(cfg: RunConfig, comm: Any, run_dir: Path) -> int:
    return asyncio.run(ProxyNode(cfg, comm, run_dir).serve())
