"""Suite-wide test settings: offline, single-threaded math, no stray network; plus two reports
the test command relies on.

* **CPU per test**: every test's CPU seconds (its own process and every child it reaped:
  engines, MPI worlds, harnesses) are printed beside its wall time at the end of the run, so a
  slow test shows whether it computes or waits.
* **No silent skip**: with `GYRE_NO_SKIP=1` (set by `tools/test.sh`) any skipped test fails
  the run unless its reason names one of `ALLOWED_SKIPS` (the CUDA-only tests on a CPU
  machine). A missing harness binary or library is an install failure, not a skip.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# shared test helpers (`import processes`) and the train tests' reference (`train.reference`)
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the only skips a CPU machine may report: tests that need a CUDA device
ALLOWED_SKIPS = ("needs a CUDA device",)
TOP = 20
SLURM_TESTS = Path(__file__).parent / "launch"
"""Where every test marked `slurm` lives: tools/test.sh's Slurm lane collects only this folder."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`--dist loadgroup`): the Slurm tests share one local cluster, so they
    run on one worker; the long tests (real MPI worlds, Slurm jobs) are handed out first, so the
    short ones fill the gaps instead of leaving one long test alone at the end."""
    for item in items:
        if item.get_closest_marker("slurm"):
            if not item.path.is_relative_to(SLURM_TESTS):
                raise pytest.UsageError(
                    f"{item.nodeid}: a Slurm test lives in tests/launch, the "
                    "only folder tools/test.sh's Slurm lane collects"
                )
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif "e2e_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("e2e"))  # one shared world, run once
        elif "learning_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("learning"))  # the same
        elif "torch_chain" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("torch_chain"))  # the same
        elif "megatron_chain" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("megatron_chain"))  # the same
        elif "replicas_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("replicas"))  # the same
        elif "judged_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("judged"))  # the same
        elif "sglang" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("sglang"))  # one import of SGLang for all
        elif "smollm2_policy" in getattr(item, "fixturenames", ()):
            # one conversion of the GGUF file (~30 CPU-s) and one engine for them all
            item.add_marker(pytest.mark.xdist_group("smollm2"))

    # pytest-xdist then hands out scopes (a group, or a test alone) in this order, except that
    # by default (--loadscope-reorder) it first puts the scopes with more tests ahead: the
    # shared-world groups start before the tests alone, whatever this key says of them
    def key(item: pytest.Item) -> int:
        marks = {m.name for m in item.iter_markers()}
        if "slurm" in marks:  # one serial group of mostly waiting: start it at once
            return 0
        # then the longest: real MPI worlds that run for minutes (learning, kill chain), ...
        return (
            1 if {"mpi", "slow"} <= marks else 2 if "mpi" in marks else 3 if "slow" in marks else 4
        )

    items.sort(key=key)


@pytest.fixture(scope="session")
def resumable_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as the runtime writes one, not run (copy it before changing it): the
    tiny model's run that checkpointed after 4 of its 6 updates (`gyre.runtime.shared.checkpoint`),
    its trace (`TraceWriter`) with one dispatched group (g8, 4 executions) the checkpoint did
    not train, and its final policy (`save_policy`). What `--resume`, `gyre eval`, `gyre
    report` and `gyre trace` read."""
    from gyre.models import load_model
    from gyre.runtime.shared import checkpoint, policies
    from gyre.runtime.shared.config import DEFAULT_CONFIG, dump_run_config, load_run_config
    from gyre.trajectory.store import TraceWriter

    tmp = tmp_path_factory.mktemp("resumable")
    run = tmp / "runs" / "local-resumable"
    run.mkdir(parents=True)
    text = dump_run_config(load_run_config(DEFAULT_CONFIG, [f"runs_dir={tmp / 'runs'}", "steps=6"]))
    (run / "config.yaml").write_text(text)
    with TraceWriter(run / "trace.h5", run_meta={"config": text, "model": "tiny"}) as w:
        for g, version in (("g7", 3), ("g8", 4)):
            w.append("groups", [{"group_id": g, "task_id": "notes@7", "execution_id": f"{g}-e{i}",
                                 "policy_version": version, "t_dispatch": time.time()}
                                for i in range(4)])  # fmt: skip
    model, tok = load_model("tiny")
    folder = checkpoint.begin(run, 4)
    checkpoint.save_core(folder, [(n, p.detach()) for n, p in model.named_parameters()], None, 4)
    state = checkpoint.CheckpointState(version=4, updates=4, trained=tuple(f"g{i}" for i in range(8)),
                                       next_group=9, t=time.time())  # fmt: skip
    checkpoint.commit(run, folder, state, keep=2)
    policies.save_policy(run, "final", model, tok, version=4)
    return run


@pytest.fixture(scope="session", autouse=True)
def engine_zygote():  # type: ignore[no-untyped-def]
    """The engines a test process starts itself (`running_engine`, `EngineHost`) are forked
    from one zygote per process, as a cell rank's are (`gyre.zygote`): a
    new interpreter, since a pytest worker already runs threads, spawned at its first engine;
    each engine after it skips ~6 CPU-s of imports. A test's CPU seconds include its
    engines' as the zygote reports them (`zygote.reaped_cpu_s`); the zygote's own go to the
    process's last test."""
    from gyre import zygote

    zygote.on_demand("gyre.rollout.server:preload")
    yield
    zygote.close()


@pytest.fixture(scope="session")
def e2e_run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The shared end-to-end `gyre run` (tests/worlds.py), run once for the session."""
    from worlds import e2e_world

    return e2e_world(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def learning_run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The default job with validation while training, then `gyre eval --initial` on it
    (tests/worlds.py `learning_world`), run once for the session."""
    from worlds import learning_world

    return learning_world(tmp_path_factory.mktemp("learning"))


@pytest.fixture(scope="session")
def torch_chain(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The shared chain of torch runs over one run directory (tests/worlds.py: preempted, then
    killed once per fatal kind and phase, resumed to the end, continued a step), run once."""
    from worlds import torch_world

    return torch_world(tmp_path_factory.mktemp("torch-chain"))


@pytest.fixture(scope="session")
def megatron_chain(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The shared chain of Megatron runs over one run directory (tests/worlds.py: preempted
    under TP 2, killed under PP 2, finished under TP 2), run once for the session."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (gyre[gpu])")
    from worlds import megatron_world

    return megatron_world(tmp_path_factory.mktemp("megatron-chain"))


@pytest.fixture(scope="session")
def replicas_run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Two 4-rank Megatron cells at TP 2 x DP 2 serving from two engines each (tests/worlds.py
    `replicas_world`), run once for the session."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (gyre[gpu])")
    from worlds import replicas_world

    return replicas_world(tmp_path_factory.mktemp("replicas"))


@pytest.fixture(scope="session")
def smollm2_policy(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """SmolLM2-135M as a run publishes it: loaded from its GGUF file (~30 CPU-s) and written
    by the runtime's `save_policy`; with the logits of a fixed prompt before saving."""
    import torch

    from gyre.models import load_model
    from gyre.runtime.shared.policies import save_policy

    model, tok = load_model("smollm2-135m")
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    path = save_policy(tmp_path_factory.mktemp("smollm2-run"), "v1", model, tok, version=1)
    return path, prompt, logits


@pytest.fixture(scope="session")
def smollm2_url(smollm2_policy):  # type: ignore[no-untyped-def]
    """One engine serving the published SmolLM2 directory for the session's SmolLM2 tests."""
    from gyre.rollout.testing import running_engine

    with running_engine(str(smollm2_policy[0]), startup_timeout=300) as url:
        yield url


def _cpu_s() -> float:
    from gyre import zygote

    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + zygote.reaped_cpu_s()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_START] = (_cpu_s(), time.monotonic())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    if call.when == "teardown" and _START in item.stash:
        cpu0, wall0 = item.stash[_START]
        item.user_properties.append(("cpu_s", _cpu_s() - cpu0))
        item.user_properties.append(("wall_s", time.monotonic() - wall0))
        item.user_properties.append(("start_s", wall0 - _T0))
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "")))
    yield


_START = pytest.StashKey[tuple[float, float]]()
_T0 = time.monotonic()  # this process's start
# nodeid -> wall_s, cpu_s, start_s (from its worker's start), worker (pytest-xdist's name)
_timings: dict[str, dict[str, Any]] = {}
_bad_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    if report.when == "teardown" and "cpu_s" in props:
        _timings[report.nodeid] = {k: props[k] for k in ("wall_s", "cpu_s", "start_s", "worker")}
    if report.skipped and os.environ.get("GYRE_NO_SKIP") == "1":
        reason = (
            str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        )
        if not any(allowed in reason for allowed in ALLOWED_SKIPS):
            _bad_skips.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if _timings:
        tr = terminalreporter
        tr.section(f"slowest {TOP} tests: wall s, CPU s (own + reaped children)")
        rows = sorted(_timings.items(), key=lambda kv: -kv[1]["wall_s"])[:TOP]
        for nodeid, t in rows:
            tr.write_line(f"{t['wall_s']:8.1f} {t['cpu_s']:8.1f}  {nodeid}")
        total_cpu = sum(t["cpu_s"] for t in _timings.values())
        tr.write_line(f"all {len(_timings)} tests: {total_cpu:.0f} CPU s")
        if path := os.environ.get("GYRE_TEST_TIMINGS"):  # every test's, for a profile
            Path(path).write_text(json.dumps(_timings, indent=1))
    if _bad_skips:
        terminalreporter.section("skips that are not allowed (GYRE_NO_SKIP=1)", red=True)
        for line in _bad_skips:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _bad_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
