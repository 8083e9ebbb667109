"""`gyre run`, `gyre eval`, `gyre report` and `gyre plan`: the whole job on one machine, its
policy on held-out tasks, its plots, and its plan (staleness, memory per rank).

    gyre run [CONFIG] [--steps S] [--policy elastic|async|colocate] [--run-dir D]
    gyre run [CONFIG] [KEY.PATH=VALUE ...] --print-config | --dry-run
    gyre eval RUN_DIR [--initial] [--policies all] [--instances N]
    gyre report RUN_DIR
    gyre plan --staleness E | --memory CONFIG [KEY.PATH=VALUE ...] [--json]

`gyre run` checks the config (unknown keys, topology, harness binary, tasks) before any
process starts, then spawns `mpiexec -n W python -m gyre.runtime.main CONFIG ...` (the
`mpich` wheel's mpiexec), renders the coordinator's progress lines live (step, waterlevel,
each cell's role, reward, staleness) and exits non-zero with the tail of the log when the job
fails. No torch import here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections import deque
from pathlib import Path
from typing import Any

from gyre import cliargs, fsafe
from gyre.errors import ConfigError
from gyre.runtime.shared.checkpoint import EXIT_CHECKPOINTED
from gyre.runtime.shared.config import DEFAULT_CONFIG, RunConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    if "run" not in subparsers.choices:
        p = subparsers.add_parser("run", help="run a whole Gyre job on this machine (MPI)")
        p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="run YAML")
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY.PATH=VALUE",
            help="config overrides after CONFIG (also after options), e.g. train.lr=3e-4",
        )
        p.add_argument("--steps", type=cliargs.count, default=None, help="optimizer updates")
        p.add_argument("--policy", default=None, help="elastic | async | colocate")
        p.add_argument(
            "--run-dir",
            type=cliargs.directory_to_make,
            default=None,
            help="default: runs/<name>-<policy>-<time>",
        )
        p.add_argument(
            "--resume",
            metavar="RUN_DIR",
            default=None,
            help="continue a run after a crash or preemption, from its newest "
            "checkpoint and its trace (config: RUN_DIR/config.yaml + overrides)",
        )
        p.add_argument("--quiet", action="store_true", help="no live display; summary only")
        p.add_argument("--print-config", action="store_true",
                       help="print the merged, validated config (YAML) and exit")  # fmt: skip
        p.add_argument("--dry-run", action="store_true",
                       help="run every check, print the command the job would start, and exit")  # fmt: skip
        p.add_argument("--profile-startup", action="store_true",
                       help="print where start-up went: seconds per phase and rank until the "
                       "first step (also the summary's `startup`)")  # fmt: skip
        p.set_defaults(func=run)
    if "eval" not in subparsers.choices:
        e = subparsers.add_parser(
            "eval", help="a policy on held-out task instances (no training)",
            description="Evaluate a run's policies, a model directory or a model spec on "
            "held-out instances of the run's tasks, with the run's harness and evaluator.",
        )  # fmt: skip
        e.add_argument("target", help="RUN_DIR | MODEL_DIR | tiny | tiny:HxL | smollm2-135m")
        e.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                       help="config overrides, e.g. eval.suite=/path/to/heldout.jsonl")  # fmt: skip
        e.add_argument(
            "--config",
            default=None,
            help="run YAML (default: the run's config.yaml, else the local template)",
        )
        e.add_argument("--tasks", nargs="+", default=None,
                       help="task names (default: eval.tasks with eval.suite, else the run's)")  # fmt: skip
        e.add_argument(
            "--instances", type=cliargs.count, default=16, help="held-out instances per task"
        )
        e.add_argument(
            "--initial", action="store_true", help="also evaluate the model the run started from"
        )
        e.add_argument(
            "--policies",
            choices=["final", "all"],
            default="final",
            help="all: every kept policy of the run (the report's eval points)",
        )
        e.add_argument(
            "--concurrency",
            type=cliargs.count,
            default=None,
            help="executions at once (default: engine.max_batch_size)",
        )
        e.add_argument(
            "--out",
            type=cliargs.directory_to_make,
            default=None,
            help="work directory: each policy's executions in DIR/NAME, replaced by each "
            "evaluation (default RUN_DIR/eval); apart from the model and the run's files",
        )
        e.add_argument("--json", action="store_true", help="one JSON line per policy")
        e.set_defaults(func=evaluate)
    if "plan" not in subparsers.choices:
        _register_plan(subparsers)
    if "report" not in subparsers.choices:
        r = subparsers.add_parser("report", help="plots + HTML page of a run directory")
        r.add_argument("run_dir", help="a run directory holding trace.h5")
        r.add_argument("--out", metavar="DIR", type=cliargs.directory_to_make, default=None,
                       help="where the plots and index.html go (default RUN_DIR/report)")  # fmt: skip
        r.set_defaults(func=report)


def _register_plan(subparsers: argparse._SubParsersAction) -> None:
    from gyre.schedule import cli as staleness

    p = subparsers.add_parser(
        "plan", help="(φ, μ) per policy for a target E[d], or a run config's memory per rank",
    )  # fmt: skip
    target = p.add_mutually_exclusive_group(required=True)
    staleness.add_arguments(p, target)
    target.add_argument("--memory", metavar="CONFIG", default=None,
                        help="a run config: each core rank's predicted bytes (weights, main "
                        "weights, gradients, moments, micro-step, update) and its engine's, "
                        "against the device's memory")  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                   help="--memory: config overrides, e.g. train.parallel.tensor=8")  # fmt: skip
    p.set_defaults(func=plan)


def plan(args: argparse.Namespace) -> int:
    """`gyre plan`: the staleness table (`gyre.schedule.cli`) or a run config's memory plan
    (`gyre.runtime.shared.memory`); exit 1 when the layout does not fit."""
    from gyre.schedule import cli as staleness

    if args.memory is None:
        if args.overrides:
            raise ConfigError(f"{' '.join(args.overrides)}: overrides go with "
                              "--memory CONFIG")  # fmt: skip
        return staleness.run(args)
    from gyre.runtime.shared.config import load_run_config
    from gyre.runtime.shared.memory import memory_plan
    from gyre.train.memory import render

    if not Path(args.memory).is_file():
        raise ConfigError(f"--memory: {args.memory!r} is not a file; allowed: a run config")
    found = memory_plan(load_run_config(args.memory, args.overrides))
    problem = found.rank_problem() or found.engine_problem()
    if args.json:
        lay = found.layout
        print(json.dumps({"fits": problem is None, "problem": problem, "window": lay.window,
                          "ranks": [{"shard": r.shard, "parameters": r.parameters,
                                     "peak": r.peak, "device": found.device_bytes(r),
                                     "in_flight": lay.in_flight(lay.stage(r.shard)), **r.parts}
                                    for r in found.ranks]}))  # fmt: skip
    else:
        print("\n".join(render(found)))
    return 1 if problem else 0


def find_mpiexec() -> str:
    """The `mpich` wheel's mpiexec beside this interpreter, else one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise ConfigError("mpiexec not found: pip install mpich mpi4py")
    return found


def run(args: argparse.Namespace) -> int:
    from gyre.runtime.main import default_run_dir, forks_ranks
    from gyre.runtime.shared.config import dump_run_config, load_run_config
    from gyre.runtime.shared.startup import table

    config, overrides = _split_overrides(args.config, args.overrides)
    if args.resume is not None:
        config, args.run_dir = _resumable(Path(args.resume), args.run_dir, config), args.resume
    cfg = load_run_config(config, overrides, steps=args.steps, policy=args.policy)
    if args.print_config:
        print(dump_run_config(cfg), end="")
        return 0
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    forked = forks_ranks(cfg)  # each rank `gyre.zygote`'s fork of one warm process
    warm = None
    if forked and not args.dry_run:  # imports what the ranks do, during the checks and launch
        from gyre import zygote

        # labelled with its run as engines are: its forks, the ranks, show its environment
        label = {"GYRE_RUN_DIR": str(run_dir.resolve())}
        try:
            warm = zygote.serve_ranks("gyre.runtime.main:preload", cfg.train.backend,
                                      ranks=cfg.topology.world_size, env={**env, **label})  # fmt: skip
        except OSError:  # no room for its socket (a full disk): the ranks start as new
            forked = False  # interpreters, and the run directory's own write says what is wrong
        else:
            env[zygote.ENV] = warm.address
    try:
        rc, summary, tail = _checked_run(args, cfg, config, run_dir, env, forked)
    except BaseException:  # a refused check (or an interrupt): the zygote at once, mid-import
        if warm is not None:
            warm.close(timeout=0)
        raise
    if warm is not None:
        warm.close()  # what is left of the ranks, and the zygote reaped
    if rc is None:  # --dry-run
        return 0
    if rc == EXIT_CHECKPOINTED and summary is not None:
        print(f"gyre run: checkpointed after {summary['steps_done']} steps; resume with "
              f"gyre run --resume {run_dir}")  # fmt: skip
        return rc
    if rc != 0 or summary is None:
        print("".join(tail), file=sys.stderr)
        print(f"gyre run: error: the job failed (exit {rc}); logs in {run_dir}; what it closed "
              f"is in its trace: continue with gyre run --resume {run_dir}", file=sys.stderr)  # fmt: skip
        return rc or 1
    print(f"gyre run: {summary['steps_done']} steps in {summary['wall_s']:.1f}s "
          f"({summary['policy']}); trace {run_dir / 'trace.h5'}")  # fmt: skip
    if "pace" in summary:
        from gyre.runtime.coordinator.progress import paced_line

        print("gyre run: " + paced_line(summary["pace"]))
    if args.profile_startup:
        print("gyre run: start-up, seconds from gyre run's start\n" + table([summary["startup"]]))
    print(json.dumps(summary))
    return 0


def _checked_run(
    args: argparse.Namespace, cfg: RunConfig, config: str, run_dir: Path,
    env: dict[str, str], forked: bool,
) -> tuple[int | None, dict[str, Any] | None, deque[str]]:  # fmt: skip
    """`gyre run`'s checks, then the MPI job (`_supervise`); rc None after `--dry-run`.
    `forked`: the ranks are forks of the rank zygote `run` started before the checks."""
    from gyre.runtime.main import ranks_config
    from gyre.runtime.preflight import Where, preflight
    from gyre.runtime.shared.config import dump_run_config
    from gyre.runtime.shared.startup import environ

    # every check, the run directory's (writable; a run there continued) too, before any write
    given = None if args.resume is not None else Path(config)  # a resume writes its own
    for note in preflight(cfg, Where.HERE, run_dir=run_dir, resume=given is None, config=given):
        print(f"gyre run: warning: {note}", file=sys.stderr)
    text = dump_run_config(cfg)  # what every rank reads: the file plus the overrides
    merged = ranks_config(run_dir, text)  # rank 0 keeps it as the run's own config.yaml
    write = not (merged.is_file() and merged.read_text() == text)
    cmd = [find_mpiexec(), "-n", str(cfg.topology.world_size), sys.executable, "-m",
           *(["gyre.zygote"] if forked else []), "gyre.runtime.main", str(merged),
           "--run-dir", str(run_dir)]  # fmt: skip
    if args.dry_run:
        t = cfg.topology
        first = f", writing the merged config to {merged} first" if write else ""
        print(f"gyre run: checks passed; would start {t.world_size} ranks (coordinator, proxy, "
              f"{t.cells} cells x {t.ranks_per_cell}, {t.standalone_engines} standalone) for "
              f"{cfg.steps} steps in {run_dir}{first}:\n{shlex.join(cmd)}")  # fmt: skip
        return None, None, deque()
    with fsafe.writing(run_dir):  # a full disk, a read-only file system: one line, exit 2
        run_dir.mkdir(parents=True, exist_ok=True)
        if write:
            merged.write_text(text)
    # environ(): when gyre run started and spawns them, which the ranks' phases count from
    env = {**env, **environ()}
    return _supervise(cmd, env, run_dir, quiet=args.quiet, limit=cfg.timeouts.run_s)


def _resumable(run_dir: Path, other: str | None, config: str) -> str:
    """The config of a run directory `gyre run --resume` can continue (its own: a CONFIG
    given as well would be ignored, so it is refused)."""
    if other is not None and Path(other) != run_dir:
        raise ConfigError(f"--resume {run_dir} and --run-dir {other}: give one run directory")
    if config != str(DEFAULT_CONFIG):
        raise ConfigError(
            f"--resume {run_dir} with CONFIG {config}: a resumed run runs its own config.yaml; "
            f"allowed: gyre run --resume {run_dir} [KEY.PATH=VALUE ...] (overrides of it), or "
            f"gyre run {config} for a new run"
        )
    own = run_dir / "config.yaml"
    if not own.is_file():
        raise ConfigError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
    return str(own)


def _split_overrides(config: str, overrides: list[str]) -> tuple[str, list[str]]:
    """`gyre run train.lr=3e-4`: the first "config" may be an override of the default one."""
    if "=" in config and not Path(config).exists():
        return str(DEFAULT_CONFIG), [config, *overrides]
    return config, list(overrides)


def _supervise(
    cmd: list[str], env: dict[str, str], run_dir: Path, *, quiet: bool, limit: float
) -> tuple[int, dict[str, Any] | None, deque[str]]:
    """Run the MPI job, render progress, keep the log tail; kill it past `limit` + margin."""
    import signal

    tail: deque[str] = deque(maxlen=60)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, start_new_session=True)  # fmt: skip
    display = _Display(quiet)
    deadline = time.monotonic() + limit + 120
    summary_box: list[dict[str, Any]] = []
    # SIGTERM / SIGHUP (`timeout`, `kill`, a closed terminal) end `gyre run` through its
    # cleanup, which takes the job down with it: the ranks run in their own session
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with open(run_dir / "job.log", "w") as log:
            _follow(proc, log, display, tail, deadline, summary_box)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = summary_box[0] if summary_box else None
    return proc.returncode, summary, tail


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _leading_json(line: str) -> dict[str, Any]:
    """The JSON object after a `GYRE-...` marker. mpiexec merges every rank's output, so
    another rank's text may follow it on the same line; that text is ignored here (it is in
    job.log)."""
    value, _ = json.JSONDecoder().raw_decode(line.split(" ", 1)[1])
    return dict(value)


def _follow(
    proc: subprocess.Popen[str], log: Any, display: _Display, tail: deque[str], deadline: float,
    summary_box: list[dict[str, Any]],
) -> None:  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith("GYRE-PROGRESS "):
                display.update(_leading_json(line))
            elif line.startswith("GYRE-SUMMARY "):
                summary_box.append(_leading_json(line))
            else:
                tail.append(line)
            if time.monotonic() > deadline:
                tail.append("gyre run: the job exceeded its wall-clock limit; killed\n")
                break
    except BaseException:  # Ctrl-C, SIGTERM: stop the job now, not after a grace period
        display.close()
        _kill_tree(proc)
        raise
    finally:
        display.close()
        if proc.poll() is None:
            try:
                proc.wait(timeout=30)  # stdout closed: the ranks are leaving
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
        proc.wait()


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


class _Display:
    """A rich live table of the coordinator's progress (plain lines when not a terminal)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.live: Any = None
        if not quiet and sys.stdout.isatty():
            from rich.live import Live

            self.live = Live(refresh_per_second=4)
            self.live.start()
        self.last_step = -1

    def update(self, p: dict[str, Any]) -> None:
        if self.quiet:
            return
        if self.live is not None:
            self.live.update(_table(p))
        elif p["step"] != self.last_step:
            self.last_step = p["step"]
            print(_line(p), flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _line(p: dict[str, Any]) -> str:
    return (f"[{p['t']:6.1f}s] step {p['step']}/{p['steps']}  waterlevel {p['waterlevel']}  "
            f"roles {' '.join(p['roles'])}  reward {_fmt(p['reward'])}  "
            f"staleness {_fmt(p['staleness'])}  reroutes {p['reroutes']}")  # fmt: skip


def _table(p: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"gyre run — step {p['step']}/{p['steps']}  ({p['t']:.0f}s)")
    for col in ("waterlevel", "version", "reward", "staleness", "loss", "reroutes", "switches"):
        t.add_column(col)
    for c in range(len(p["roles"])):
        t.add_column(f"cell {c}")
    t.add_row(*[_fmt(p[k]) for k in ("waterlevel", "version", "reward", "staleness", "loss",
                                     "reroutes", "switches")], *p["roles"])  # fmt: skip
    return t


def evaluate(args: argparse.Namespace) -> int:
    from gyre.runtime.evaluation import run_eval

    results = run_eval(
        args.target, config=args.config, tasks=args.tasks, instances=args.instances,
        initial=args.initial, every=args.policies == "all", concurrency=args.concurrency,
        out=args.out, overrides=args.overrides,
    )  # fmt: skip
    for r in results:
        d = r.to_dict()
        if args.json:
            print(json.dumps(d))
        else:
            print(f"gyre eval: {r.name:>8} (v{r.version}) held-out reward {r.mean:.3f} "
                  f"± {r.std:.3f} over {d['n']} executions ({d['excluded']} excluded), "
                  f"{r.wall_s:.0f}s")  # fmt: skip
    return 0


def report(args: argparse.Namespace) -> int:
    from gyre.runtime.report import write_report

    page = write_report(Path(args.run_dir), None if args.out is None else Path(args.out))
    print(f"gyre report: {page}")
    return 0
