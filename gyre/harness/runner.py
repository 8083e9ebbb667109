"""The harness runner: one execution's harness as a supervised subprocess (asyncio).

`HarnessRunner.run(spec)` prepares a fresh workspace (copy of the task's initial state),
starts the adapter's command in its own session/process group with only the environment
it needs, waits until it exits, its harness time budget runs out, or it is cancelled, and
returns the `Terminated` event. On timeout or cancellation the whole process group gets
SIGTERM, then SIGKILL after a grace period; leftovers of a normally exiting harness are
killed too. The workspace is preserved for the evaluator. Every step is reported to
`on_event` (`Launched`, then exactly one `Terminated`), so a coordinator or the proxy
node's Tornado loop can host a pool of runners:

    runner = HarnessRunner(HarnessRunner.Config(workspace_root="runs/ws"), on_event=queue.put_nowait)
    terminated = await runner.run(ExecutionSpec(execution_id="g0-e3", task=task,
        adapter=get_adapter("reference"), proxy_url="http://127.0.0.1:8000", api_key=key,
        model="tiny"))

Problems with the input (bad execution id, missing initial state, program not found) do not
raise: the execution terminates FAILED with the reason and `assessable=False`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from gyre.errors import ConfigError, HarnessError
from gyre.harness import sandbox
from gyre.harness.adapters import Adapter
from gyre.harness.events import HarnessEvent, Launched, Terminated
from gyre.harness.workspace import ExecutionDir, harness_env, prepare
from gyre.lifetime import die_with_parent
from gyre.tasks.suite import Task
from gyre.vocabulary import Outcome

log = logging.getLogger(__name__)
KILL_SETTLE_S = 5.0  # how long to wait for SIGKILLed processes to disappear


@dataclass(frozen=True, slots=True)
class ExecutionSpec:
    """What to run for one execution."""

    execution_id: str
    task: Task
    adapter: Adapter
    proxy_url: str  # proxy root, e.g. http://127.0.0.1:8000 (no /v1)
    api_key: str  # this execution's key from the proxy's admin route
    model: str
    params: dict[str, str] = field(default_factory=dict)  # adapter parameter overrides
    harness_timeout_s: float | None = None  # None: the runner's default
    overall_timeout_s: float | None = None


class HarnessRunner:
    """Runs harness subprocesses, one per execution, and reports their lifecycle."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Harness runner settings."""

        # directory holding one sub-directory per execution
        workspace_root: str
        # wall-clock budget of one harness, seconds
        harness_timeout_s: float = 3600.0
        # budget of harness + evaluation retries, seconds from launch (>= harness_timeout_s)
        overall_timeout_s: float = 4800.0
        # seconds between SIGTERM and SIGKILL of the process group
        kill_grace_s: float = 3.0
        # none | bwrap (bubblewrap required) | apptainer (apptainer_image) | auto (bwrap when
        # installed); what a sandboxed harness sees: gyre/harness/sandbox.py
        sandbox: Literal["none", "bwrap", "apptainer", "auto"] = "none"
        # apptainer: the image (.sif or sandbox directory) that brings the operating system
        apptainer_image: str = ""
        # names of runner environment variables passed through (e.g. OMP_NUM_THREADS)
        keep_env: list[str] = field(default_factory=list)
        # directories a sandboxed harness must not see (e.g. the run directory)
        hide: list[str] = field(default_factory=list)

        def __post_init__(self) -> None:
            if not self.workspace_root:
                raise ConfigError("workspace_root: must be set")
            for name in ("harness_timeout_s", "overall_timeout_s", "kill_grace_s"):
                if not getattr(self, name) > 0:
                    raise ConfigError(f"{name}: {getattr(self, name)!r} must be > 0")
            if self.overall_timeout_s < self.harness_timeout_s:
                raise ConfigError(
                    f"overall_timeout_s: {self.overall_timeout_s!r} must be >= harness_timeout_s "
                    f"({self.harness_timeout_s!r}); the overall budget includes the harness"
                )
            if self.sandbox == "apptainer" and not self.apptainer_image:
                raise ConfigError("apptainer_image: must be set for sandbox 'apptainer'")

    def __init__(
        self, config: Config, on_event: Callable[[HarnessEvent], None] | None = None
    ) -> None:
        self.config = config
        self.root = Path(config.workspace_root).resolve()
        self._on_event = on_event
        self._cancel: dict[str, asyncio.Event] = {}
        self._reasons: dict[str, str] = {}
        self._ended: set[str] = set()  # executions whose Terminated was emitted

    @property
    def running(self) -> list[str]:
        """Execution ids whose harness is being prepared or runs."""
        return list(self._cancel)

    @property
    def sandbox(self) -> str:
        if self.config.sandbox == "auto":
            return "bwrap" if sandbox.bwrap_available() else "none"
        return self.config.sandbox

    def cancel(self, execution_id: str, reason: str = "cancelled by the coordinator") -> bool:
        """Ask a running execution to stop; False when it is not running."""
        event = self._cancel.get(execution_id)
        if event is None:
            return False
        self._reasons[execution_id] = reason
        event.set()
        return True

    def send_feedback(self, execution_id: str, text: str) -> None:
        """Append evaluator feedback for a running execution's harness to read.

        Adapters that pass `{feedback_file}` (the reference agent) show it to the model in a
        user message sent with the evaluator provenance header.
        """
        path = self.root / execution_id / "feedback.jsonl"
        if execution_id not in self._cancel or not path.exists():
            raise HarnessError(f"execution {execution_id!r} is not running here")
        with open(path, "a") as f:  # in place: a bwrap bind mount keeps the same inode
            f.write(json.dumps({"text": text}) + "\n")

    async def run(self, spec: ExecutionSpec) -> Terminated:
        """Prepare, launch and supervise one execution's harness; never raises on bad input."""
        eid = spec.execution_id
        if eid in self._cancel:
            raise HarnessError(f"execution {eid!r} is already running")
        self._cancel[eid] = asyncio.Event()
        t0 = time.time()
        deadline = t0 + (spec.overall_timeout_s or self.config.overall_timeout_s)
        try:
            return await self._run(spec, t0, deadline)
        except asyncio.CancelledError:
            if eid not in self._ended:  # cancelled before launch: still exactly one Terminated
                reason = "runner task cancelled before launch"
                self._end(eid, Outcome.CANCELLED, reason, None, None, deadline, None, False)
            raise
        finally:
            self._cancel.pop(eid, None)
            self._reasons.pop(eid, None)
            self._ended.discard(eid)

    async def _run(self, spec: ExecutionSpec, t0: float, deadline: float) -> Terminated:
        eid = spec.execution_id
        try:
            ex = await asyncio.to_thread(prepare, self.root, eid, spec.task)
        except HarnessError as e:
            return self._end(
                eid, Outcome.FAILED, f"setup failed: {e}", None, None, deadline, None, False
            )
        try:
            argv, env = await asyncio.to_thread(self._command, spec, ex)  # reads the disk
        except (HarnessError, ConfigError) as e:
            return self._end(eid, Outcome.FAILED, str(e), None, None, deadline, ex, False)
        with open(ex.stdout, "wb") as out, open(ex.stderr, "wb") as err:
            try:
                proc = await self._spawn(argv, env, ex, out, err)
            except OSError as e:
                reason = f"harness command {argv[0]!r} could not start: {e.strerror or e}"
                return self._end(eid, Outcome.FAILED, reason, None, None, deadline, ex, False)
            t_launch = time.time()
            self._emit(
                Launched(
                    execution_id=eid,
                    pid=proc.pid,
                    t=t_launch,
                    workspace=str(ex.workspace),
                    sandbox=self.sandbox,
                )
            )
            try:
                outcome, reason = await self._supervise(spec, proc)
            except asyncio.CancelledError:
                await self._kill_group(proc)
                self._end(
                    eid,
                    Outcome.CANCELLED,
                    "runner task cancelled",
                    proc.returncode,
                    t_launch,
                    deadline,
                    ex,
                    True,
                )
                raise
        if outcome is Outcome.FAILED:
            reason = f"{reason}; stderr: {_tail(ex.stderr)}"
        return self._end(eid, outcome, reason, proc.returncode, t_launch, deadline, ex, True)

    def _command(self, spec: ExecutionSpec, ex: ExecutionDir) -> tuple[list[str], dict[str, str]]:
        adapter: Adapter = spec.adapter
        values = {
            "python": sys.executable,
            "instruction": spec.task.instruction,
            "instruction_file": str(ex.instruction_file),
            "feedback_file": str(ex.feedback_file),
            "workspace": str(ex.workspace),
            "model": spec.model,
            "execution_id": spec.execution_id,
        }
        argv, adapter_env = adapter.render(values, spec.params)
        keep = {k: os.environ[k] for k in self.config.keep_env if k in os.environ}
        env = harness_env(
            adapter, adapter_env, ex, execution_id=spec.execution_id, task=spec.task,
            proxy_url=spec.proxy_url, api_key=spec.api_key, keep=keep,
        )  # fmt: skip
        program = adapter.resolve_program(env["PATH"])
        if program is None:
            hint = f"; install it with {adapter.install}" if adapter.install else ""
            raise HarnessError(
                f"harness command {adapter.command[0]!r} not found on PATH {env['PATH']!r} "
                f"or in {adapter.search_path}{hint}"
            )
        argv[0] = program
        env["PATH"] = os.pathsep.join([str(Path(program).parent), env["PATH"]])
        if self.sandbox == "none":
            return argv, env
        mounts = sandbox.allow_list(
            ex, program=program, binds=adapter.sandbox_paths(), hidden=spec.task.hidden_paths,
            hide=[Path(d) for d in self.config.hide], workspace_root=self.root,
        )  # fmt: skip
        if self.sandbox == "apptainer":
            prefix, env = sandbox.apptainer_argv(
                mounts, ex.workspace, self.config.apptainer_image, env, home=ex.home
            )
            return prefix + argv, env
        return sandbox.bwrap_argv(mounts, ex.workspace) + argv, env

    @staticmethod
    async def _spawn(
        argv: list[str], env: dict[str, str], ex: ExecutionDir, out: IO[bytes], err: IO[bytes]
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(  # the harness dies with the proxy node
            *die_with_parent(argv), cwd=ex.workspace, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip

    async def _supervise(
        self, spec: ExecutionSpec, proc: asyncio.subprocess.Process
    ) -> tuple[Outcome, str]:
        budget = spec.harness_timeout_s or self.config.harness_timeout_s
        exited = asyncio.ensure_future(proc.wait())
        cancelled = asyncio.ensure_future(self._cancel[spec.execution_id].wait())
        try:
            await asyncio.wait(
                {exited, cancelled}, timeout=budget, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            cancelled.cancel()
        if exited.done():
            await self._kill_group(proc)  # background leftovers of a finished harness
            rc = proc.returncode
            if rc == 0:
                return Outcome.COMPLETED, ""
            return Outcome.FAILED, f"harness exited with status {rc}"
        await self._kill_group(proc)
        if self._cancel[spec.execution_id].is_set():
            return Outcome.CANCELLED, self._reasons.get(spec.execution_id, "cancelled")
        return (
            Outcome.TIMED_OUT,
            f"harness exceeded its time budget of {budget:g}s; process group killed",
        )

    async def _kill_group(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period, reap the leader."""
        pgid = proc.pid
        if not _signal_group(pgid, signal.SIGTERM):
            await proc.wait()
            return
        await _wait_group_gone(pgid, self.config.kill_grace_s)
        if _signal_group(pgid, signal.SIGKILL):
            await _wait_group_gone(pgid, KILL_SETTLE_S)  # SIGKILL is delivered asynchronously
        await proc.wait()

    def _end(
        self, eid: str, outcome: Outcome, reason: str, rc: int | None, t_launch: float | None,
        deadline: float, ex: ExecutionDir | None, assessable: bool,
    ) -> Terminated:  # fmt: skip
        event = Terminated(
            execution_id=eid, outcome=outcome, reason=reason, returncode=rc, t=time.time(),
            t_launch=t_launch, deadline=deadline,
            workspace=str(ex.workspace) if ex else None,
            stdout_path=str(ex.stdout) if ex else None,
            stderr_path=str(ex.stderr) if ex else None,
            assessable=assessable,
        )  # fmt: skip
        self._ended.add(eid)
        self._emit(event)
        return event

    def _emit(self, event: HarnessEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # a broken listener must not leave a harness unsupervised
            log.exception("harness event listener failed on %r", event)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and _group_alive(pgid):
        await asyncio.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process of the group remains."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _tail(path: Path, n: int = 400) -> str:
    try:
        data = path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return "(unreadable)"
    return data or "(empty)"
