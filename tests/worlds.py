"""Real `gyre run` worlds, each run once and shared by the tests that only read it (tests only).

`e2e_world(base)` runs the end-to-end job once — the small config of tests/runtime (2 steps,
three cells), a suite with a learnable task, a slow one and one whose evaluator always
crashes, every experiment tracker on, and cell 2's engine SIGKILLed while harnesses are live —
and returns what a test reads from it (with `--profile-startup`: its start-up table is in the
output). The `e2e_run` fixture (tests/conftest.py) hands it to
the end-to-end assertions, the trace export and the trace stats tests; tests that use it are
put on one pytest-xdist worker, so the world runs once per test session.

`learning_world(base)` is the default job (templates/local.yaml, 40 steps) with validation
while training on (`eval.every_steps=20`: held-out points at steps 0, 20 and 40, 2 instances
each, one sample logged, TensorBoard on), then `gyre eval --initial --instances 48` on its run
directory. The `learning_run` fixture hands it to the learning test (tests/runtime/
test_learning.py: the held-out reward rises) and the validation tests (tests/runtime/
test_validation.py: the held-out points never train, the report shows them), on one
pytest-xdist worker.

`replicas_world(base)` is one `gyre run` of two 4-rank Megatron cells at TP 2 x DP 2, each
serving from two engines, under colocate, batches recorded: the `replicas_run` fixture hands it
to the cell-engine test (tests/runtime/test_cell_engines.py: every engine served, was released
and came back on the published policy) and the data-parallel invariance test (every update
equals the one-process reference), on one pytest-xdist worker.

`megatron_world(base)` is a chain of `gyre run`s over one run directory with Megatron cells
(train.backend megatron, 2-rank cells, batches recorded, the invariance tests' objective
overrides): preempted under tensor parallelism (TP 2 x PP 1; SIGUSR1: checkpoint, exit 75),
resumed under two pipeline stages (`gyre run --resume RUN_DIR train.parallel.pipeline=2`)
and killed mid-run (the core cell's second rank, SIGKILL) once that segment has a checkpoint
of its own, then resumed under TP 2 again (`train.parallel.pipeline=1`) to the end. Each
segment is a `Segment` record: the checkpoint it started from, what it closed before and
after its signal or kill, its first update, the batch records it left. The `megatron_chain`
fixture hands it to the kill matrix (tests/runtime/test_kill_matrix.py) and the invariance
test (tests/runtime/test_training_invariance.py), on one pytest-xdist worker.

`torch_world(base)` is the kill matrix's chain of torch runs, built from the same pieces
(`preempt`, `kill_during`, `resume`): two 2-rank cells, batches recorded under the same
objective overrides, preempted, then killed once per fatal kind and phase (`FATAL_KILLS`),
resumed to the end and continued one step further. The `torch_chain` fixture hands it to the
kill matrix's fatal-kill test and to the invariance test, which replays every update of the
chain against the one-process reference.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from processes import Proc, gone, scan, wait_for
from runtime.conftest import crashing_suite, small_config, write_config

ROOT = Path(__file__).resolve().parents[1]
KILLED_ENGINE = 2
TRACKERS = {"tensorboard": {"enabled": True}, "wandb": {"enabled": True},
            "mlflow": {"enabled": True}}  # fmt: skip


@dataclass(frozen=True)
class World:
    run_dir: Path
    returncode: int
    output: str  # `gyre run`'s stdout and stderr
    engine_killed: bool  # cell 2's engine was SIGKILLed while harnesses ran
    kill_t: float  # unix time of the kill
    live_on_killed: tuple[str, ...]  # open executions whose last call that engine served


def _live_on(run_dir: Path, engine_id: str) -> list[str]:
    """Open executions of the live trace whose newest recorded call `engine_id` served."""
    from gyre.errors import StoreError
    from gyre.trajectory.reader import TraceReader

    try:
        with TraceReader(run_dir / "trace.h5") as r:
            open_ = {i.execution_id for i in r.executions() if not i.closed}
            return [eid for eid, tree in r.recover().items()
                    if eid in open_ and tree.nodes and tree.nodes[-1].engine_id == engine_id]  # fmt: skip
    except (StoreError, OSError):  # not there yet, or the writer holds it a moment
        return []


def _kill_engine_when_busy(
    proc: subprocess.Popen, run_dir: Path, index: int
) -> tuple[bool, float, list[str]]:
    """SIGKILL engine `index` once it serves live executions (seen in the live trace); returns
    (killed, when, those executions); (False, 0, []) if the run ended first."""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        live = _live_on(run_dir, f"e{index}") if (run_dir / "trace.h5").exists() else []
        engines = [p.pid for p in scan(run_dir) if p.kind == "engine" and p.index == index]
        pid = engines[0] if len(live) >= 2 and engines else None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            return True, time.time(), live
        time.sleep(0.3)
    return False, 0.0, []


@functools.cache
def e2e_world(base: Path) -> World:
    cfg = small_config(base, steps=2)
    cfg["harness"]["suite"] = str(crashing_suite(base))
    # groups draw tasks round robin: the learnable notes often, so a batch's rewards differ
    cfg["harness"]["tasks"] = ["notes", "add", "crashy", "notes", "fizzbuzz"]
    cfg["harness"]["params"].update({"max_turns": "3", "max_tokens": "96", "delegate": "off"})
    cfg["schedule"]["batch_groups"] = 3
    # the crashy evaluator gives up after 2 attempts (not at the overall budget), so its
    # groups are ready, and set aside, within the 2 steps
    cfg["harness"]["eval_attempts"] = 2
    cfg["tracking"] = TRACKERS
    path = write_config(base, cfg)
    run_dir = base / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre", "run", str(path), "--run-dir", str(run_dir),
         "--profile-startup"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=base,
    )  # fmt: skip
    try:
        killed, kill_t, live = _kill_engine_when_busy(proc, run_dir, KILLED_ENGINE)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return World(run_dir, proc.returncode, out, killed, kill_t, tuple(live))


LEARNING_STEPS, EVAL_EVERY = 40, 20
VALIDATION = {"eval.every_steps": EVAL_EVERY, "eval.instances": 2, "eval.concurrency": 2,
              "eval.log_samples": 1, "tracking.tensorboard.enabled": "true"}  # fmt: skip


@dataclass(frozen=True)
class Learned:
    run_dir: Path
    run: subprocess.CompletedProcess[str]  # `gyre run templates/local.yaml ...`
    eval: subprocess.CompletedProcess[str] | None  # `gyre eval RUN --initial`; None: no run
    tensorboard: Path  # a copy of the run's TensorBoard logs as the run left them (`gyre eval`
    # then sends its initial and final held-out rewards to the same eval/* tags, steps 0 and 40)


@functools.cache
def learning_world(base: Path) -> Learned:
    run_dir = base / "run"

    def gyre(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gyre", *args], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)  # fmt: skip

    overrides = [f"{k}={v}" for k, v in VALIDATION.items()]
    run = gyre("run", "templates/local.yaml", "--steps", str(LEARNING_STEPS), *overrides,
               "--run-dir", str(run_dir), "--quiet", timeout=1500)  # fmt: skip
    tensorboard = base / "tensorboard-of-the-run"
    if run.returncode != 0:
        return Learned(run_dir, run, None, tensorboard)
    shutil.copytree(run_dir / "tensorboard", tensorboard)
    ev = gyre("eval", str(run_dir), "--initial", "--instances", "48", "--json", timeout=600)
    return Learned(run_dir, run, ev, tensorboard)


# ------------------------------------------------------------- cells of several engines and replicas

INVARIANCE_STEPS = 3
"""Updates of the invariance worlds (tests/runtime/test_training_invariance.py's runs too)."""
REPLICA_BUDGET = 1600
"""The replicas world's token budget: two rows (~750 tokens each) packed into a micro-step,
so each data-parallel replica gets rows (at 256 each row trains alone and the second replica
gets none)."""


@dataclass(frozen=True)
class Ran:
    run_dir: Path
    returncode: int
    output: str  # the tail of `gyre run`'s stdout and stderr


@functools.cache
def replicas_world(base: Path) -> Ran:
    """Two 4-rank Megatron cells at TP 2 x DP 2 (DP implied by `train.parallel.tensor=2`),
    each serving from two engines (`engine.per_cell=2`: engine j on the cell's rank j), under
    colocate (every cell trains every batch, so both split its micro-steps and both switch
    back to rollout after each update), batches recorded under the invariance objective, six
    groups of four on `notes` a batch. The `replicas_run` fixture hands it to the cell-engine
    test (tests/runtime/test_cell_engines.py) and the data-parallel invariance test."""
    cfg = small_config(base, steps=INVARIANCE_STEPS)
    cfg["topology"].update(cells=2, ranks_per_cell=4)
    cfg["engine"]["per_cell"] = 2
    cfg["harness"].update({"suite": "learn", "tasks": ["notes"]})
    cfg["harness"]["params"].update({"max_turns": "3", "max_tokens": "96"})
    cfg["schedule"].update(policy="colocate", phi=0.0, mu=1, group_size=4, batch_groups=6)
    cfg["train"].update(record_batches=True, token_budget=REPLICA_BUDGET, backend="megatron",
                        parallel={"tensor": 2}, **OBJECTIVE)  # fmt: skip
    run_dir = base / "run"
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", str(write_config(base, cfg)), "--run-dir",
         str(run_dir), "--quiet"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return Ran(run_dir, out.returncode, (out.stdout + out.stderr)[-4000:])


# --------------------------------------------------------------------------- chains of runs

CHAIN_STEPS = 4
# a mid-run kill leaves at least two steps to go: with one, a loaded machine once finished the
# run between the kill's trigger and the kill (the next segment then had nothing to resume)
OBJECTIVE = {"clip_low": 0.9, "clip_high": 1.2, "token_weight_cap": 3.0}
"""Non-default clip bounds and IS cap: the invariance runs give them as overrides."""
SECOND_RANK = 3  # world rank of the core cell's second rank: coordinator 0, proxy 1, core 2 + 3


def start_run(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gyre", "run", *args, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def steps_done(run_dir: Path) -> int:
    """The step count of the current segment's progress lines (-1: none yet)."""
    log = run_dir / "job.log"
    done = -1
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("GYRE-PROGRESS "):
                try:
                    done = max(done, json.loads(line.split(" ", 1)[1])["step"])
                except (ValueError, KeyError):
                    continue
    return done


def wait_steps(run_dir: Path, proc: subprocess.Popen[str], n: int, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while (done := steps_done(run_dir)) < n:
        assert proc.poll() is None, f"the run ended before step {n}"
        assert time.monotonic() < deadline, f"no step {n} within {timeout}s"
        time.sleep(0.2)
    return done


def mid_run(run_dir: Path, proc: subprocess.Popen[str]) -> None:
    """Past start-up and, where the run has steps left, one step further than it began
    (never past step CHAIN_STEPS - 2: two steps are left when the kill lands)."""
    first = wait_steps(run_dir, proc, 0)
    wait_steps(run_dir, proc, min(CHAIN_STEPS - 2, first + 1))


def kill(victims: list[Proc]) -> list[int]:
    for p in victims:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(p.pid, signal.SIGKILL)
    return [p.pid for p in victims]


def job_errors(run_dir: Path) -> str:
    """The job log's lines that are not progress lines (where a rank's error goes)."""
    log = run_dir / "job.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(x for x in lines if not x.startswith("GYRE-PROGRESS"))[-3000:]


def finish(proc: subprocess.Popen[str], timeout: float = 400) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def rank_pids(run_dir: Path) -> list[int]:
    return [p.pid for p in scan(run_dir) if p.kind == "rank"]


@dataclass(frozen=True)
class Closed:
    """A closed execution as the trace holds it."""

    status: str
    tree: str  # sha256 of the tree's nodes: tokens, log-probs, parents, roles, versions
    rewards: frozenset  # (group, reward, valid) rows recorded for it so far

    def kept_in(self, later: Closed) -> bool:
        """Nothing of it is lost in `later`: same status and tree, every reward row still there
        (a resume may add the score of an execution that closed unscored)."""
        return (self.status, self.tree) == (later.status, later.tree) and (
            self.rewards <= later.rewards
        )


def closed_in(run_dir: Path) -> dict[str, Closed]:
    """Every closed execution of the trace on disk: its status, tree digest and reward rows.
    Read live (SWMR) before a kill as well as after it; empty while there is no trace yet."""
    from gyre.trajectory.reader import TraceReader

    if not (run_dir / "trace.h5").exists():
        return {}
    with TraceReader(run_dir / "trace.h5") as r:
        rewards: dict[str, list[tuple]] = {}
        for row in r.rows("rewards"):
            reward = float(row["reward"])  # NaN (no valid score) compares as None
            key = (row["group_id"], None if reward != reward else round(reward, 9),
                   bool(row["valid"]))  # fmt: skip
            rewards.setdefault(row["execution_id"], []).append(key)
        return {
            i.execution_id: Closed(i.status, _digest(r.tree(i.execution_id)),
                                   frozenset(rewards.get(i.execution_id, ())))
            for i in r.executions() if i.closed
        }  # fmt: skip


def closed_live(run_dir: Path, known: dict[str, Closed]) -> dict[str, Closed]:
    """`closed_in` a running job's trace. A reopening writer rewrites the superblock's flags
    in place (`clear_write_flags`), so an open at that moment may fail: it is tried again,
    and at worst what is known from the last segment stands in for it."""
    from gyre.errors import StoreError

    for _ in range(20):
        try:
            return closed_in(run_dir)
        except (StoreError, OSError):
            time.sleep(0.1)
    return known


def _digest(tree: object) -> str:
    data = tree.to_dict()  # type: ignore[attr-defined]
    for node in data["nodes"]:  # wall-clock times are not content
        node.pop("t_start", None), node.pop("t_end", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def lost(before: dict[str, Closed], after: dict[str, Closed]) -> list[str]:
    """What of `before` is missing or changed in `after`, each as `id: before -> after`."""
    return [f"{e}: {c} -> {after.get(e)}" for e, c in before.items()
            if e not in after or not c.kept_in(after[e])]  # fmt: skip


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint of the run directory."""

    name: str  # v<version>
    state: dict[str, Any]  # its state.json: updates, version, groups trained
    core: dict[str, Any]  # its core state: version, named (HF layout) weights, AdamW state


def newest_checkpoint(run_dir: Path) -> Checkpoint | None:
    from gyre.runtime.shared.checkpoint import latest
    from gyre.train import core_file

    found = latest(run_dir)
    if found is None:
        return None
    # a torch core's core.pt, or a Megatron core's per-rank shards put together
    return Checkpoint(found[0].name, found[1], core_file.load(found[0]))


@dataclass(frozen=True)
class Segment:
    """One `gyre run` of a chain over one run directory, as the tests read it afterwards."""

    args: tuple[str, ...]  # after `gyre run`
    returncode: int
    output: str  # its output's tail and the job log's error lines
    error: str  # what went wrong while it was driven ("": nothing)
    t_start_ns: int  # when it was started (time.time_ns)
    resumed_from: Checkpoint | None  # the newest checkpoint when it started
    checkpoint: Checkpoint | None  # the newest checkpoint when it ended
    closed_before: dict[str, Closed]  # read live just before its signal or kill
    closed_after: dict[str, Closed]  # read once it ended
    killed: tuple[int, ...]  # the pids it SIGKILLed
    outlived: bool  # a process alive at the kill was still alive 30 s after the job ended
    first_update: dict[str, Any] | None  # the core record of its first batch, if it made one
    batches: dict[str, int]  # RUN_DIR/batches files -> mtime_ns when it ended
    config: dict[str, Any]  # RUN_DIR/config.yaml when it ended
    summary: dict[str, Any]  # RUN_DIR/summary.json when it ended ({}: none)

    @property
    def first_batch(self) -> int:
        """The batch it began with: the updates of the checkpoint it started from."""
        return int(self.resumed_from.state["updates"]) if self.resumed_from else 0

    @property
    def layout(self) -> tuple[int, int]:
        """(tensor, pipeline) of its cells, as its config.yaml says."""
        from gyre.train.backends import backend
        from gyre.train.config import ParallelConfig

        train = self.config["train"]
        dims = backend(train["backend"]).dims(
            ParallelConfig(**train["parallel"]), self.config["topology"]["ranks_per_cell"]
        )
        return dims.tensor, dims.pipeline


# what a segment's driver does while it runs: (closed before, pids killed, pids alive then)
Act = Callable[[subprocess.Popen[str]], tuple[dict[str, Closed], list[int], list[int]]]


def _segment(run_dir: Path, args: list[str], act: Act | None, timeout: float) -> Segment:
    """`gyre run ARGS` over `run_dir`, driven by `act` (if any) while it runs; its record.
    An assertion or timeout of the driver is recorded as its `error`, not raised."""
    resumed_from = newest_checkpoint(run_dir)
    if act is not None:
        (run_dir / "job.log").unlink(missing_ok=True)  # the segment's own progress, from zero
    t0 = time.time_ns()
    proc = start_run(args)
    before: dict[str, Closed] = {}
    killed: list[int] = []
    everything: list[int] = []
    error, out = "", ""
    try:
        if act is not None:
            before, killed, everything = act(proc)
        _, out = finish(proc, timeout)
    except (AssertionError, subprocess.TimeoutExpired) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if proc.poll() is None:
            proc.kill()
        out = out or proc.communicate()[0]
    outlived = bool(everything) and not gone(everything)
    closed = closed_live(run_dir, {})
    return Segment(
        args=tuple(args), returncode=proc.returncode, output=out[-3000:] + job_errors(run_dir),
        error=error, t_start_ns=t0, resumed_from=resumed_from,
        checkpoint=newest_checkpoint(run_dir), closed_before=before, closed_after=closed,
        killed=tuple(killed), outlived=outlived,
        first_update=_update_since(run_dir, resumed_from, t0), batches=_batch_files(run_dir),
        config=_run_config(run_dir), summary=_run_summary(run_dir),
    )  # fmt: skip


def _update_since(run_dir: Path, resumed_from: Checkpoint | None, t0: int) -> dict | None:
    """The core record of the first batch after `resumed_from`, if written since `t0`."""
    import torch

    from gyre.runtime.shared.audit import AUDIT_DIR

    batch = int(resumed_from.state["updates"]) if resumed_from else 0
    path = run_dir / AUDIT_DIR / f"b{batch:05d}-core.pt"
    if not path.exists() or path.stat().st_mtime_ns < t0:
        return None
    try:
        return torch.load(path, weights_only=False)
    except Exception:  # cut short by a kill: it made no update that lasted
        return None


def _run_config(run_dir: Path) -> dict[str, Any]:
    own = run_dir / "config.yaml"
    return yaml.safe_load(own.read_text()) if own.is_file() else {}


def _run_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _batch_files(run_dir: Path) -> dict[str, int]:
    from gyre.runtime.shared.audit import AUDIT_DIR

    folder = run_dir / AUDIT_DIR
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} if folder.is_dir() else {}


def preempt(run_dir: Path, args: list[str]) -> Segment:
    """`gyre run ARGS`, sent SIGUSR1 on every rank after its first optimizer step (what
    Slurm's --signal=USR1@T does): it checkpoints and exits 75."""

    def act(proc: subprocess.Popen[str]) -> tuple[dict[str, Closed], list[int], list[int]]:
        wait_steps(run_dir, proc, 1)
        before = closed_live(run_dir, {})
        for pid in rank_pids(run_dir):
            os.kill(pid, signal.SIGUSR1)
        return before, [], []

    return _segment(run_dir, args, act, timeout=240)


def kill_during(run_dir: Path, overrides: list[str], victims_of: Callable[[list[Proc]], list[Proc]],
                phase: str, *, checkpointed: bool = False) -> Segment:  # fmt: skip
    """`gyre run --resume RUN_DIR OVERRIDES`, whose `victims_of(its processes)` are SIGKILLed
    during start-up (`phase` "startup": every rank up, engines starting) or mid-run; with
    `checkpointed`, only once the segment has committed a checkpoint of its own (its first
    batch then stays in the run's final chain of updates)."""
    known = closed_in(run_dir)  # the last segment's, while no writer holds the trace
    first = _committed(run_dir)

    def act(proc: subprocess.Popen[str]) -> tuple[dict[str, Closed], list[int], list[int]]:
        if phase == "startup":
            wait_for(run_dir, "engine", 1)
        else:
            mid_run(run_dir, proc)
        deadline = time.monotonic() + 300
        while checkpointed and _committed(run_dir) <= first:
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint of its own within 300s"
            time.sleep(0.1)
        procs = scan(run_dir)
        victims = victims_of(procs)
        assert victims, f"no process to kill among {procs}"
        before = closed_live(run_dir, known)
        return before, kill(victims), [p.pid for p in procs]

    return _segment(run_dir, ["--resume", str(run_dir), *overrides], act, timeout=120)


def _committed(run_dir: Path) -> int:
    """The updates of the newest checkpoint (0: none)."""
    from gyre.runtime.shared.checkpoint import latest

    found = latest(run_dir)
    return int(found[1]["updates"]) if found else 0


def resume(run_dir: Path, overrides: list[str]) -> Segment:
    """`gyre run --resume RUN_DIR OVERRIDES`, left to finish."""
    return _segment(run_dir, ["--resume", str(run_dir), *overrides], None, timeout=400)


@dataclass(frozen=True)
class Chain:
    run_dir: Path
    segments: tuple[Segment, ...]  # in the order they ran; the chain stops at one's error


def _second_rank(procs: list[Proc]) -> list[Proc]:
    """The core cell's second rank: the other half of every layer (TP), or the second stage."""
    return [p for p in procs if p.kind == "rank" and p.index == SECOND_RANK]


FATAL: dict[str, Callable[[list[Proc]], list[Proc]]] = {
    # kind -> which processes to kill, by world rank in a world of 2-rank cells:
    # coordinator 0, proxy 1, core cell 2 (leader, hosts the engine) + 3, satellite 4 + 5
    "coordinator": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 0],
    "proxy node": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 1],
    "core cell's leader": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 2],
    "satellite cell's second rank": lambda ps: [p for p in ps if p.kind == "rank" and p.index == 5],
    "everything": lambda ps: list(ps),
}
# start-up kills (each a world start of its own, ~35 s here): the rank that hosts an engine,
# and every process at once; any one rank's death ends the world the same way (MPI aborts it)
STARTUP_KILLS = ("core cell's leader", "everything")
FATAL_KILLS = tuple((kind, phase) for kind in FATAL for phase in ("startup", "midrun")
                    if phase == "midrun" or kind in STARTUP_KILLS)  # fmt: skip
"""(kind, phase) of the torch chain's killed segments, in the order they run."""
TORCH_BUDGET = 256
"""The torch chain's token budget: ~30 micro-steps a batch, so the satellite joins batches
(as in the Megatron chain) and some rows are over it (the invariance test's oversize rows)."""


@functools.cache
def torch_world(base: Path) -> Chain:
    """The kill matrix's chain of torch runs over one run directory (two 2-rank cells, batches
    recorded, checkpoint every step, the invariance tests' objective overrides): preempted
    (SIGUSR1), then resumed and SIGKILLed once per `FATAL_KILLS` entry, then resumed to the
    end, then continued for one more step (`--resume RUN_DIR --steps CHAIN_STEPS+1`)."""
    cfg = small_config(base, steps=CHAIN_STEPS)
    cfg["topology"].update({"cells": 2, "ranks_per_cell": 2})  # core + one satellite
    cfg["harness"]["params"].update({"max_turns": "2", "max_tokens": "96"})
    cfg["train"].update({"record_batches": True, "token_budget": TORCH_BUDGET})
    cfg["checkpoint"] = {"every_steps": 1, "keep": 2}
    config = write_config(base, cfg)
    run_dir = base / "run"
    objective = [f"train.{k}={v}" for k, v in OBJECTIVE.items()]
    segments = [preempt(run_dir, [str(config), *objective, "--run-dir", str(run_dir)])]
    for kind, phase in FATAL_KILLS:
        if segments[-1].error:
            break
        segments.append(kill_during(run_dir, [], FATAL[kind], phase))
    if not segments[-1].error:
        segments.append(resume(run_dir, []))
    if not segments[-1].error:
        segments.append(resume(run_dir, ["--steps", str(CHAIN_STEPS + 1)]))
    return Chain(run_dir, tuple(segments))


@functools.cache
def megatron_world(base: Path) -> Chain:
    cfg = small_config(base, steps=CHAIN_STEPS)
    cfg["topology"].update({"cells": 2, "ranks_per_cell": 2})  # core + one satellite
    cfg["harness"]["params"].update({"max_turns": "2", "max_tokens": "96"})
    # token_budget 256: ~30 micro-steps a batch, so the satellite joins before the core has
    # taken them all (at 1024 the SDPA core's faster micro-steps often left it none, at 512
    # it still did on a loaded machine)
    cfg["train"].update({"record_batches": True, "token_budget": 256})
    # the satellite joins whenever passes are left (the count check alone): the tiny model's
    # batch trains in 1-2 s, and the cost-aware check, weighing that against the satellite's
    # measured round trip of switches, often (and since reloads leave from the stages, in
    # every batch of a run) kept it out, so nothing was split; and whenever a pass is left
    # (`join_min_microsteps` 1, not 16): on a loaded machine the core had taken all but a few
    # before the satellite's join came up (a full suite, 2026-12-07: "only cells {0} trained")
    cfg["schedule"].update({"join_payback": 0, "join_min_microsteps": 1})
    cfg["checkpoint"] = {"every_steps": 1, "keep": 2}
    config = write_config(base, cfg)
    run_dir = base / "run"
    # the objective and the layouts come from the command line: `gyre run CONFIG KEY=VALUE`,
    # `gyre run --resume RUN_DIR KEY=VALUE`
    objective = [f"train.{k}={v}" for k, v in OBJECTIVE.items()]
    segments = [preempt(run_dir, [str(config), *objective, "train.backend=megatron",
                                  "train.parallel.pipeline=1", "--run-dir", str(run_dir)])]  # fmt: skip
    if not segments[-1].error:
        segments.append(kill_during(run_dir, ["train.parallel.pipeline=2"], _second_rank,
                                    "midrun", checkpointed=True))  # fmt: skip
    if not segments[-1].error:
        segments.append(resume(run_dir, ["train.parallel.pipeline=1"]))
    return Chain(run_dir, tuple(segments))
