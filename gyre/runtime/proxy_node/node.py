"""The proxy node (world rank 1): the proxy, the harness pool and the evaluator.

One asyncio/Tornado loop hosts an `ExecutionHost`: the `ProxyApp` (harness-facing APIs,
TITO recording, routes), a `HarnessRunner` (one subprocess per execution, in its own
workspace) and the `Evaluator` (scores each preserved workspace after its execution ends);
`gyre eval` runs the same host without training. A thread receives the
coordinator's messages (`gyre.runtime.shared.wire`) and hands them to the loop (one handler per type):
`SetEngines`, `SetJudges` (the judge engines the judge rule asks), `Drain`, `Undrain`, `StartExecution` (register the execution's key, route it,
run its harness on its task instance), `Cancel`, `Evaluate` (validation while training: the
held-out set on the live rollout engines, its calls journaled nowhere, answered with
`Evaluated`), `Stop`.

For each execution the node reports, in this order, `HarnessEnded` (outcome, timings) and
`Assessed` (the closed trajectory tree, the verdict and every assessment). A switch's
reroute: `Drain` marks the source engine so the proxy starts no new call there and sets
the reserved destinations, then acks with `Drained`; the cell aborts its calls afterwards,
and the router retries each aborted call at its execution's new route (one node, attempts
counted), so the harness never sees the switch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gyre.harness import ExecutionSpec, HarnessRunner, Terminated
from gyre.harness.judge import HarnessJudge
from gyre.harness.sandbox import ScorerSandbox
from gyre.proxy.app import ProxyApp
from gyre.proxy.config import Config as ProxyConfig
from gyre.rollout.protocol import engine_key
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared import wire
from gyre.runtime.shared.config import RunConfig
from gyre.runtime.shared.harness import load_tasks
from gyre.runtime.shared.heldout import EVAL_ID, heldout, is_evaluation, run_heldout
from gyre.runtime.shared.layout import COORDINATOR_RANK
from gyre.tasks import AssessmentLog, Evaluator
from gyre.tasks.judge import Judge
from gyre.tasks.scoring import Transcript, rules
from gyre.tasks.suite import Task, TaskSuite
from gyre.trajectory.transcript import transcript
from gyre.trajectory.tree import TrajectoryTree
from gyre.vocabulary import Outcome


def proxy_config(cfg: RunConfig) -> ProxyConfig:
    """The run's proxy config as the proxy node serves it: role rules are the run's
    `proxy.role_rules` (first, so an operator overrides) then the adapter's shipped ones;
    the sampling seed follows `train.seed` when the run sets none (repeatable calls); SGLang
    engines report constrained calls' log-probs grammar-masked, so the proxy rescores them."""
    proxy = cfg.proxy
    rules = [*proxy.role_rules, *cfg.harness.adapter_object().role_rules]
    seed = cfg.train.seed if proxy.sampling_seed is None else proxy.sampling_seed
    masked = "masked" if cfg.engine.backend == "sglang" else proxy.constrained_logprobs
    return dataclasses.replace(
        proxy, role_rules=rules, sampling_seed=seed, constrained_logprobs=masked
    )


class ExecutionHost:
    """The proxy, the harness pool and the evaluator: runs executions end to end.

    The proxy node of a run drives it from the coordinator's messages; `gyre eval` drives
    the same object directly, so an evaluation runs exactly what a training run runs.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, hide: Sequence[Path] = ()) -> None:
        """`run_dir` holds the executions' workspaces; it, the folder of runs beside it and
        `hide` are invisible to a sandboxed harness."""
        self.cfg, self.run_dir = cfg, run_dir
        self.suite, self.task_names = load_tasks(cfg)  # the run's one load of its suite
        self.adapter = cfg.harness.adapter_object()
        h = cfg.harness
        # harnesses, the agentic judge and scorers: one sandbox, one list of what it hides
        kind = "bwrap" if h.sandbox == "auto" else h.sandbox
        hidden = [str(d) for d in (run_dir, run_dir.resolve().parent, *hide)]
        self.runner = HarnessRunner(
            HarnessRunner.Config(
                workspace_root=str(run_dir / "workspaces"),
                harness_timeout_s=h.harness_timeout_s,
                overall_timeout_s=h.overall_timeout_s,
                kill_grace_s=h.kill_grace_s,
                keep_env=["OMP_NUM_THREADS", "HF_HUB_OFFLINE"],
                sandbox=kind,
                apptainer_image=h.apptainer_image,
                hide=hidden,
            )
        )
        agent = HarnessJudge(
            kind, apptainer_image=h.apptainer_image,
            keep_env=["OMP_NUM_THREADS", "HF_HUB_OFFLINE"], hide=hidden,
        )  # fmt: skip
        # the judge rule: a task's own endpoint, else the run's judge engines (`SetJudges`)
        self.judge = Judge(api_key=engine_key(), agent=agent)
        # scoring runs the policy's code: confined as its harness was, and offline
        confine = None if kind == "none" else ScorerSandbox(
            kind, workspace_root=run_dir / "workspaces", apptainer_image=h.apptainer_image,
            hide=tuple(map(Path, hidden)),
        )  # fmt: skip
        self.evaluator = Evaluator(
            Evaluator.Config(max_attempts=h.eval_attempts), log=AssessmentLog(),
            rules={**rules(confine), "judge": self.judge},
        )  # fmt: skip
        self.app: ProxyApp | None = None
        self.url = ""
        self.tokenizer: Any = None  # the model's (`start`): decodes transcripts

    async def start(self, engines: dict[str, str], journal: Any = None) -> str:
        """Load the tokenizer, listen on a free port; returns the proxy's URL.

        `journal` receives every recorded node as it is made (`record_node(eid, node)`), on
        the event loop, in order (a run's proxy node forwards them to the coordinator).
        """
        from gyre.models import load_tokenizer

        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, load_tokenizer, self.cfg.model)
        self.tokenizer = tokenizer
        self.app = ProxyApp(
            proxy_config(self.cfg), tokenizer=tokenizer, engines=engines,
            admin_token=secrets.token_hex(16),
        )  # fmt: skip
        if journal is not None:
            self.app.service.store = journal
        self.app.service.routing_top_k = await loop.run_in_executor(None, self.cfg.routing_top_k)
        self.url = f"http://127.0.0.1:{self.app.listen(0)}"
        return self.url

    @property
    def proxy(self) -> ProxyApp:
        assert self.app is not None, "ExecutionHost.start() first"
        return self.app

    async def execute(
        self, eid: str, task: Task, engine_id: str | None,
        ended: Callable[[Terminated], None] | None = None,
        closed: Callable[[TrajectoryTree | None], None] | None = None,
    ) -> tuple[Terminated, msg.VerdictRecord]:  # fmt: skip
        """One execution: key, route, harness, close, score -> (ended, verdict).

        `engine_id`: its route (None: the router picks a live engine for each call).
        `ended` is called as soon as the harness ends, before the tree is closed and scored;
        `closed` with the closed tree. The closed tree is dropped from the proxy: a run's
        proxy node sent each of its nodes to the coordinator as it was recorded
        (`_Journal`), and the coordinator writes the trace.
        """
        app = self.proxy
        key = app.register_execution(eid, role="main", meta={"task": task.instance_id})
        if engine_id is not None:
            app.set_route(eid, engine_id)
        spec = ExecutionSpec(
            execution_id=eid, task=task, adapter=self.adapter, proxy_url=self.url,
            api_key=key, model=self.cfg.model_name, params=self.cfg.harness.adapter_params,
        )  # fmt: skip
        term = await self.runner.run(spec)
        if ended is not None:
            ended(term)
        tree = app.close_execution(eid, term.outcome.value)  # the router forgets it too
        if closed is not None:
            closed(tree)
        said = self.transcript(tree, task)
        app.forget_execution(eid)
        return term, await self._assess(term, task, said)

    def transcript(self, tree: TrajectoryTree | None, task: Task) -> Transcript | None:
        """The execution's transcript from its tree, for a task whose rule reads it
        (`scoring.transcript`); None for any other task, or without a tree."""
        if not task.scoring.transcript or tree is None:
            return None
        return self.read_transcript(tree)

    def read_transcript(self, tree: TrajectoryTree) -> Transcript:
        """The execution's transcript (`gyre.trajectory.transcript`), decoded with the model's
        tokenizer: what a rule reads, and an in-run evaluation's sample."""
        tok = self.tokenizer

        def decode(ids: Sequence[int]) -> str:
            return str(tok.decode(list(ids), skip_special_tokens=True))

        return transcript(tree, decode)

    async def _assess(
        self, term: Terminated, task: Task, said: Transcript | None = None
    ) -> msg.VerdictRecord:
        t0 = time.time()
        try:
            v = await self.evaluator.assess(term, task, said)
        except Exception as e:  # an evaluator bug must not stall the group: excluded
            return msg.VerdictRecord.excluded(f"evaluator crashed: {e}", t0)
        attempts = tuple(self.evaluator.log.for_execution(term.execution_id))
        return msg.VerdictRecord(status=v.status, reward=v.reward, t=time.time(),
                                 error=v.assessment.error, assessments=attempts,
                                 tests=v.tests)  # fmt: skip

    async def rescore(
        self, eid: str, task: Task, tree: TrajectoryTree | None = None
    ) -> msg.VerdictRecord:
        """Score an execution's preserved workspace after the job running it died; `tree`:
        its journaled calls (the coordinator's), for a rule that reads the transcript."""
        workspace = Path(self.runner.config.workspace_root) / eid / "workspace"
        now = time.time()
        term = Terminated(
            execution_id=eid, outcome=Outcome.FAILED, returncode=None, t=now, t_launch=None,
            reason="the job running it died; scored from its preserved workspace",
            deadline=now + self.cfg.harness.overall_timeout_s,
            workspace=str(workspace) if workspace.is_dir() else None,
            stdout_path=None, stderr_path=None, assessable=workspace.is_dir(),
        )  # fmt: skip
        return await self._assess(term, task, self.transcript(tree, task))

    def stop(self) -> None:
        for eid in self.runner.running:
            self.runner.cancel(eid, "stopped")
        if self.app is not None:
            self.app.stop()


class ProxyNode:
    """Everything rank 1 runs, on one event loop: an `ExecutionHost` driven by the coordinator."""

    def __init__(self, cfg: RunConfig, link: wire.Link, run_dir: Path) -> None:
        self.cfg, self.link = cfg, link
        self.host = ExecutionHost(cfg, run_dir)
        self.tasks: set[asyncio.Task[None]] = set()
        self.heldout: tuple[TaskSuite, list[str]] | None = None  # eval suite, its tasks
        if cfg.eval.every_steps:  # validation while training: the held-out set, loaded once
            eval_cfg, names = heldout(cfg, None)
            self.heldout = (load_tasks(eval_cfg)[0], names)

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        url = await self.host.start({}, journal=_Journal(self._up))
        gc.freeze()  # start-up objects (tokenizer, modules) leave the collector's scans
        inbox: asyncio.Queue[Any] = asyncio.Queue()  # messages, or the link's failure
        threading.Thread(target=self._receive, args=(loop, inbox), daemon=True).start()
        self._up(msg.ProxyReady(url, tuple(self.host.task_names)))
        handlers: dict[type, Any] = {
            msg.SetEngines: self.set_engines, msg.Drain: self.drain, msg.Undrain: self.undrain,
            msg.StartExecution: self.start_execution, msg.Cancel: self.cancel,
            msg.Rescore: self.rescore, msg.Evaluate: self.evaluate,
            msg.SetJudges: self.set_judges,
        }  # fmt: skip
        while True:
            m = await inbox.get()
            if isinstance(m, Exception):  # the coordinator is gone: fail the job loudly
                raise m
            if isinstance(m, msg.Stop):
                break
            handlers[type(m)](m)
        for task in list(self.tasks):
            task.cancel()
        self.host.stop()
        return m.status

    def _receive(self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[Any]) -> None:
        while True:  # blocks in select: waiting costs nothing
            try:
                m = self.link.recv(timeout=60.0)
            except wire.RuntimeFailure as e:
                loop.call_soon_threadsafe(inbox.put_nowait, e)
                return
            if m is None:
                continue
            loop.call_soon_threadsafe(inbox.put_nowait, m)
            if isinstance(m, msg.Stop):
                return

    def _up(self, m: msg.Message) -> None:
        self.link.send(m, COORDINATOR_RANK)

    # ------------------------------------------------------------------ messages

    def set_engines(self, m: msg.SetEngines) -> None:
        for engine_id, url in m.urls.items():
            self.host.proxy.add_engine(engine_id, url)

    def set_judges(self, m: msg.SetJudges) -> None:
        """The judge engines (`topology.judge_engines`): the judge rule asks them when a
        task names no `judge.endpoint`."""
        self.host.judge.use_engines(m.urls)

    def drain(self, m: msg.Drain) -> None:
        """No new call at the engine; set the reserved routes; ack (a switch waits for it)."""
        self.host.proxy.set_draining(m.engine, True)
        for eid, dest in m.routes.items():
            self.host.proxy.set_route(eid, dest)
        if m.ack:
            self._up(msg.Drained(m.engine))

    def undrain(self, m: msg.Undrain) -> None:
        self.host.proxy.set_draining(m.engine, False)

    def start_execution(self, m: msg.StartExecution) -> None:
        task = asyncio.ensure_future(self._execute(m))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def cancel(self, m: msg.Cancel) -> None:
        for eid in m.execution_ids:
            self.host.runner.cancel(eid, "cancelled at the end of the run")

    def rescore(self, m: msg.Rescore) -> None:
        async def run() -> None:
            task = self.host.suite[m.task].instantiate(m.instance)
            verdict = await self.host.rescore(m.execution_id, task, m.tree)
            self._up(msg.Assessed(m.execution, verdict, 0))

        task = asyncio.ensure_future(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def evaluate(self, m: msg.Evaluate) -> None:
        """Validation while training: the held-out set on the rollout engines (`run_heldout`,
        as `gyre eval` runs it), then `Evaluated`."""
        assert self.heldout is not None, "Evaluate without eval.every_steps"
        suite, names = self.heldout
        e = self.cfg.eval

        async def run() -> None:
            t0 = time.time()
            ran = await run_heldout(self.host, suite, names, instances=e.instances,
                                    concurrency=e.concurrency, prefix=f"{EVAL_ID}s{m.step}",
                                    engine=m.engine, keep=e.log_samples)  # fmt: skip
            self._up(msg.Evaluated(m.step, ran.rewards, tuple(sorted(ran.versions)),
                                   tuple(sorted(ran.engines)), t0, time.time(),
                                   dict(ran.transcripts)))  # fmt: skip

        task = asyncio.ensure_future(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _execute(self, m: msg.StartExecution) -> None:
        """Run one execution; reports `HarnessEnded`, then `Assessed`."""
        task = self.host.suite[m.task].instantiate(m.instance)

        def ended(term: Terminated) -> None:
            self._up(msg.HarnessEnded(m.execution, term.outcome, term.t_launch, term.t,
                                      term.reason))  # fmt: skip

        term, verdict = await self.host.execute(m.execution_id, task, m.engine, ended)
        self._up(msg.Assessed(m.execution, verdict, _errors(term)))


class _Journal:
    """The proxy service's store inside a run: every recorded node goes to the coordinator.

    The coordinator writes the run's one trace; it opened the execution at launch and
    closes it on `Assessed` with exactly these nodes, so this store only forwards nodes.
    Sends happen on the event loop, in recording order, before the execution's
    `HarnessEnded`: the control connection keeps them in that order.
    """

    def __init__(self, up: Callable[[msg.Message], None]) -> None:
        self.up = up

    def open_execution(self, execution_id: str, meta: Any) -> None:
        return None

    def record_node(self, execution_id: str, node: Any) -> None:
        if is_evaluation(execution_id):  # held-out: never in the trace, never trained
            return
        self.up(msg.JournalNode(execution_id, node))

    def close_execution(self, execution_id: str, tree: Any, *, status: str, meta: Any) -> None:
        return None


def _errors(term: Terminated) -> int:
    """Harness-side errors: a harness that failed (non-zero exit: it gave up on an API error)."""
    return 1 if term.outcome is Outcome.FAILED else 0


def run_proxy_node(cfg: RunConfig, link: wire.Link, run_dir: Path) -> int:
    return asyncio.run(ProxyNode(cfg, link, run_dir).serve())
