"""Run config, world layout and bad input: each a clear message, never a hang."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from processes import gone, scan, wait_for

from gyre.errors import ConfigError
from gyre.harness import get_adapter
from gyre.runtime.main import keep_config
from gyre.runtime.proxy_node.node import proxy_config
from gyre.runtime.shared.config import (
    RunSchedule,
    TopologyConfig,
    dump_run_config,
    load_run_config,
)
from gyre.runtime.shared.harness import check_adapter
from gyre.runtime.shared.layout import (
    cell_members,
    cell_of_rank,
    cell_ranks,
    engine_ranks,
    engine_shards,
    hosts_engine,
    layout,
)
from gyre.schedule.config import Config as SchedulerConfig
from gyre.schedule.config import ScheduleConfig
from gyre.vocabulary import RoleRule

from .conftest import ROOT, small_config, write_config


def test_templates_load() -> None:
    local = load_run_config(ROOT / "templates" / "local.yaml")
    assert local.model == "tiny" and local.topology.world_size == 5
    smol = load_run_config(ROOT / "templates" / "smollm2.yaml")
    assert smol.model == "smollm2-135m"
    over = load_run_config(ROOT / "templates" / "local.yaml", steps=7, policy="async")
    assert over.steps == 7 and over.schedule.policy == "async"


def test_the_train_section_is_the_trainers_config(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg["train"].update({"clip_low": 0.8, "clip_high": 1.01, "token_weight_cap": 2.0, "lr": 3e-4})
    got = load_run_config(write_config(tmp_path, cfg), ["train.j_max=3", "train.beta2=0.99"])
    assert (got.train.objective.clip_low, got.train.objective.clip_high) == (0.8, 1.01)
    assert got.train.objective.token_weight_cap == 2.0
    assert (got.train.optim.lr, got.train.optim.beta2) == (3e-4, 0.99)
    assert got.train.admission.j_max == 3
    assert load_run_config(ROOT / "templates" / "local.yaml").train.j_max == 5  # the paper's
    with pytest.raises(
        ConfigError, match=r"run\.train: unknown key 'clip_hi'; allowed keys: .*clip_high"
    ):
        load_run_config(write_config(tmp_path, cfg), ["train.clip_hi=1.2"])
    with pytest.raises(ConfigError, match=r"run\.train\.clip_low/clip_high: 0.8/0.9"):
        load_run_config(write_config(tmp_path, cfg), ["train.clip_high=0.9"])
    # the valid-group rule reaches the packing buffer; one no group can meet is refused
    got = load_run_config(write_config(tmp_path, cfg), ["train.min_group_outcomes=3"])
    assert got.train.stream(groups_per_batch=2, group_size=4).min_outcomes == 3
    with pytest.raises(ConfigError, match=r"min_group_outcomes: 5; allowed: at most schedule"):
        load_run_config(write_config(tmp_path, cfg), ["train.min_group_outcomes=5"])
    with pytest.raises(ConfigError, match=r"max_empty_batches: 0; allowed an integer >= 1"):
        load_run_config(write_config(tmp_path, cfg), ["train.max_empty_batches=0"])


def test_unknown_key_names_the_path(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg["schedule"]["bogus"] = 1
    with pytest.raises(ConfigError, match=r"schedule.*bogus"):
        load_run_config(write_config(tmp_path, cfg))


def test_the_proxy_gets_the_runs_role_rules_then_the_adapters(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg["harness"] = {"adapter": "claude_code"}
    own = {"role": "planner", "source": "first_user", "pattern": "(?i)make a plan"}
    cfg["proxy"]["role_rules"] = [own]
    got = proxy_config(load_run_config(write_config(tmp_path, cfg)))
    shipped = get_adapter("claude_code").role_rules
    assert got.role_rules == [RoleRule(**own), *shipped] and len(shipped) == 2
    cfg["proxy"]["role_rules"] = [{**own, "source": "body"}]
    with pytest.raises(ConfigError, match=r"run.proxy.role_rules\[0\].source: 'body' is not "
                       r"allowed; choose one of 'system', 'first_user', 'last_user', 'headers'"):  # fmt: skip
        load_run_config(write_config(tmp_path, cfg))


def test_bad_policy_lists_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"elastic.*async.*colocate"):
        load_run_config(write_config(tmp_path, small_config(tmp_path)), policy="fifo")


def test_rank_0_keeps_the_config_gyre_run_wrote(tmp_path: Path) -> None:
    cfg = load_run_config(write_config(tmp_path, small_config(tmp_path)))
    path = tmp_path / "config.yaml"  # as `gyre run` writes it: the merged file every rank reads
    path.write_text(dump_run_config(cfg))
    written = path.stat().st_ino
    keep_config(path, dump_run_config(load_run_config(path)))
    assert path.stat().st_ino == written  # read back, it dumps to the same text: kept
    keep_config(path, dump_run_config(load_run_config(path, steps=5)))  # sbatch's --steps
    assert path.stat().st_ino != written and load_run_config(path).steps == 5


def test_the_schedule_section_is_the_schedulers_fields(tmp_path: Path) -> None:
    """The run's `schedule:` is the scheduler's own `ScheduleConfig` (declared once: same
    defaults) plus the policy choice; the scheduler gets every one of its values."""
    policy = {"policy", "streaming", "train_cells"}
    shape = {k: t for k, t in _field_types(RunSchedule).items() if k not in policy}
    assert (
        shape == _field_types(ScheduleConfig)
        and shape.items() <= _field_types(SchedulerConfig).items()
    )
    assert RunSchedule().shape() == ScheduleConfig().shape()
    got = load_run_config(write_config(tmp_path, small_config(tmp_path)), ["schedule.mu=4"])
    sc, _ = got.schedule.scheduler(got.topology)
    assert (sc.mu, sc.group_size, sc.cells) == (4, got.schedule.group_size, got.topology.cells)
    with pytest.raises(ConfigError, match=r"run\.schedule\.phi: -1\.0 is negative"):
        load_run_config(write_config(tmp_path, small_config(tmp_path)), ["schedule.phi=-1"])


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def test_impossible_topologies(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, schedule={"policy": "async", "train_cells": 3})
    with pytest.raises(ConfigError, match="train_cells"):  # no rollout engine left
        load_run_config(write_config(tmp_path, cfg))
    cfg = small_config(tmp_path, topology={"cells": 0})
    with pytest.raises(ConfigError, match="cells"):
        load_run_config(write_config(tmp_path, cfg))
    with pytest.raises(ConfigError, match=r"world size 4 does not match.*5 ranks"):
        layout(4, TopologyConfig(cells=3))
    # a cell of R ranks: the world grows by R per cell, the leader of each cell hosts its engine
    cfg = small_config(tmp_path, topology={"ranks_per_cell": 2})
    topology = load_run_config(write_config(tmp_path, cfg)).topology
    assert topology.world_size == 2 + 3 * 2
    components = layout(topology.world_size, topology)
    assert cell_members(components) == [[2, 3], [4, 5], [6, 7]]
    assert engine_ranks(components) == [2, 4, 6]


@given(
    cells=st.integers(1, 6), ranks=st.integers(1, 4), standalone=st.integers(0, 3),
    extra=st.integers(-3, 3),
)  # fmt: skip
def test_layout_maps_every_rank_once(cells: int, ranks: int, standalone: int, extra: int) -> None:
    topo = TopologyConfig(cells=cells, ranks_per_cell=ranks, standalone_engines=standalone)
    size = 2 + cells * ranks + standalone + extra
    if extra != 0:
        with pytest.raises(ConfigError):
            layout(size, topo)
        return
    comps = layout(size, topo)
    assert comps[0].kind == "coordinator" and comps[1].kind == "proxy"
    # each cell: `ranks` consecutive world ranks, shards 0..R-1 in order
    members = cell_members(comps)
    assert members == [list(range(2 + c * ranks, 2 + (c + 1) * ranks)) for c in range(cells)]
    assert all([comps[r].shard for r in m] == list(range(ranks)) for m in members)
    assert cell_of_rank(comps) == [None, None, *[c for c in range(cells) for _ in range(ranks)],
                                   *[None] * standalone]  # fmt: skip
    assert cell_ranks(comps) == [m[0] for m in members]  # the leaders
    first_standalone = 2 + cells * ranks
    assert engine_ranks(comps) == [m[0] for m in members] + list(range(first_standalone, size))


@given(
    cells=st.integers(1, 4), per_cell=st.integers(1, 3), stride=st.integers(1, 2),
    spare=st.integers(0, 2), standalone=st.integers(0, 2), judges=st.integers(0, 1),
)  # fmt: skip
def test_the_ranks_that_fork_an_engine_zygote_are_the_ranks_that_host_engines(
    cells: int, per_cell: int, stride: int, spare: int, standalone: int, judges: int
) -> None:
    """A rank forks an engine zygote (`gyre.runtime.main.fork_engine_zygote`) exactly when it
    hosts an engine: each cell's engine ranks (`engine_ranks`), the standalone and the judge
    engines; never the coordinator, the proxy node or a cell rank that only trains."""
    ranks = per_cell * stride + spare
    topo = TopologyConfig(cells=cells, ranks_per_cell=ranks, standalone_engines=standalone,
                          judge_engines=judges)  # fmt: skip
    comps = layout(topo.world_size, topo)
    shards = engine_shards(per_cell, stride)
    forking = {r for r, c in enumerate(comps) if hosts_engine(c, shards)}
    judge_ranks = {r for r, c in enumerate(comps) if c.kind == "judge"}
    assert forking == set(engine_ranks(comps, shards)) | judge_ranks
    assert len(judge_ranks) == judges and not forking & {0, 1}


@pytest.mark.parametrize("override,forked", [
    ({}, True), ({"topology": {"zygote": False}}, False),
    ({"train": {"device": "cuda"}}, False), ({"engine": {"device": "cuda"}}, False),
    ({"engine": {"backend": "sglang"}}, False),
])  # fmt: skip
def test_gyre_run_forks_its_ranks_only_where_nothing_is_on_a_gpu(
    override: dict, forked: bool
) -> None:
    """`gyre run` forks the ranks from its rank zygote (`forks_ranks`) unless
    `topology.zygote` is off or anything of the run is on a GPU: CUDA does not survive a
    fork, and a rank on a GPU may touch it while it starts."""
    from gyre.config import load
    from gyre.runtime.main import forks_ranks
    from gyre.runtime.shared.config import RunConfig

    assert forks_ranks(load(RunConfig, override, path="run")) is forked


def test_a_cluster_config_is_refused_by_gyre_run_before_anything_starts(tmp_path: Path) -> None:
    """`gyre run` starts every rank here: a 194-rank cluster template is refused, naming the
    way to run it (it used to start 194 ranks on this machine)."""
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", str(ROOT / "templates/cluster/swe-24.yaml"),
         "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "topology: 194 ranks (1 coordinator + 1 proxy + 6 cells x 32 ranks" in out.stderr
    assert "gyre submit CONFIG" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 30 and not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_sigterm_to_gyre_run_takes_the_whole_job_down(tmp_path: Path) -> None:
    """`timeout gyre run ...`, `kill PID`: the ranks run in their own session, yet none of
    them, their engines or harnesses outlives `gyre run`."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre", "run", str(write_config(tmp_path, small_config(tmp_path))),
         "--run-dir", str(run_dir), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(run_dir, "engine", 1)  # every rank is up, engines are starting
        everything = [p.pid for p in scan(run_dir)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert gone(everything), [p for p in scan(run_dir)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for left in scan(run_dir):  # only when the test failed: leave nothing running
            with contextlib.suppress(ProcessLookupError):
                os.kill(left.pid, signal.SIGKILL)


def test_missing_harness_binary_fails_before_anything_starts(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg["harness"]["adapters"] = {
        "ghost": {"api": "openai", "command": ["gyre-no-such-harness", "{instruction}"]}
    }
    cfg["harness"]["adapter"] = "ghost"
    path = write_config(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"gyre-no-such-harness.*not on PATH"):
        check_adapter(load_run_config(path), program=True)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "gyre", "run", str(path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "gyre-no-such-harness" in out.stderr
    assert time.monotonic() - t0 < 30 and not (tmp_path / "runs").exists()


def test_unknown_task_and_unknown_key_via_cli(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg["harness"]["tasks"] = ["add", "no-such-task"]
    out = subprocess.run([sys.executable, "-m", "gyre", "run", str(write_config(tmp_path, cfg))],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "no-such-task" in out.stderr
    cfg = small_config(tmp_path, colour="blue")
    out = subprocess.run([sys.executable, "-m", "gyre", "run", str(write_config(tmp_path, cfg))],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "colour" in out.stderr


@pytest.mark.mpi
def test_world_of_wrong_size_aborts_with_a_message(tmp_path: Path) -> None:
    from gyre.runtime.cli import find_mpiexec

    path = write_config(tmp_path, small_config(tmp_path))
    out = subprocess.run(
        [find_mpiexec(), "-n", "3", sys.executable, "-m", "gyre.runtime.main", str(path),
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "world size 3 does not match" in out.stdout + out.stderr


@pytest.mark.mpi
def test_a_harness_that_always_fails_stops_the_run_with_its_own_error(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    boom = "import sys; sys.exit('harness boom 17')"
    cfg["harness"]["adapters"] = {
        "broken": {"api": "openai", "command": [sys.executable, "-c", boom]}
    }
    cfg["harness"]["adapter"] = "broken"
    # the reference agent's params do not fit this adapter: refused before anything starts
    out = subprocess.run([sys.executable, "-m", "gyre", "run", str(write_config(tmp_path, cfg))],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert "harness.params: unknown parameter 'compact_at' for adapter 'broken'" in out.stderr
    cfg["harness"]["params"] = {}
    cfg["steps"], cfg["train"]["max_empty_batches"] = 3, 2
    path = write_config(tmp_path, cfg)
    out = subprocess.run([sys.executable, "-m", "gyre", "run", str(path), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0
    # one batch of failure placeholders skips its update; the second in a row stops the run
    assert "GYRE-WARNING step 1 had nothing to train and skipped its update" in text, text[-3000:]
    assert "2 batches in a row had nothing to train" in text and "failed/" in text, text[-3000:]
    assert "harness boom 17" in text, text[-3000:]


def test_the_engine_backend_chooses_what_a_cell_launches(tmp_path: Path, monkeypatch) -> None:
    """`engine.backend`: both backends start from the same launch presets, with the run's
    engine key; the embedded engine picks its port and prints its URL, SGLang gets one."""
    from gyre.rollout.protocol import ENGINE_KEY_ENV
    from gyre.runtime.cell.engine_host import EngineHost
    from gyre.runtime.shared.config import EngineConfig

    monkeypatch.setenv(ENGINE_KEY_ENV, "k3y")
    log = tmp_path / "engine.log"
    argv, url = EngineHost("tiny", EngineConfig(threads=2), log, version=5).command()
    assert argv[1:] == ["-m", "gyre.rollout.cli", "--model", "tiny", "--host", "127.0.0.1",
                        "--port", "0", "--weight-version", "5", "--threads", "2",
                        "--max-batch-size", "8", "--prefix-cache-mb", "64"] and url == ""  # fmt: skip
    sglang = EngineConfig(backend="sglang", tensor_parallel=4, mem_fraction_static=0.7)
    argv, url = EngineHost("/models/qwen", sglang, log, version=2).command()
    port = url.rsplit(":", 1)[1]
    assert argv[1:3] == ["-m", "sglang.launch_server"] and url == f"http://127.0.0.1:{port}"
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert (flags["--model-path"], flags["--port"], flags["--tp-size"]) == (
        "/models/qwen",
        port,
        "4",
    )
    assert (flags["--mem-fraction-static"], flags["--weight-version"]) == ("0.7", "2")
    assert argv[argv.index("--api-key") + 1] == "k3y"


def test_a_backend_this_machine_cannot_run_is_refused_in_one_line(tmp_path: Path) -> None:
    for override, words in [("engine.backend=sglang", "engine.backend: sglang"),
                            ("engine.backend=vllm", "engine.backend")]:  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "gyre", "run", "templates/local.yaml", override,
             "--run-dir", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert words in out.stderr and "embedded" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert not (tmp_path / "run").exists()


LOCAL = ROOT / "templates" / "local.yaml"


@pytest.mark.parametrize(
    "overrides,dims",
    [
        (["topology.ranks_per_cell=2"], (1, 1, 2, False)),  # torch: data parallel in the cell
        (["topology.ranks_per_cell=2", "train.backend=megatron"], (2, 1, 1, True)),
        (["topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.sequence=false"],
         (2, 1, 1, False)),
        (["topology.ranks_per_cell=4", "train.backend=megatron", "train.parallel.tensor=4"],
         (4, 1, 1, True)),
        (["topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.pipeline=2"],
         (1, 2, 1, False)),  # one layer of the tiny model per stage
        (["topology.ranks_per_cell=4", "train.backend=megatron", "train.parallel.pipeline=2"],
         (2, 2, 1, True)),
        # data parallelism inside a Megatron cell: implied by tensor, or set
        (["topology.ranks_per_cell=4", "train.backend=megatron", "train.parallel.tensor=2"],
         (2, 1, 2, True)),
        (["topology.ranks_per_cell=4", "train.backend=megatron", "train.parallel.data=2"],
         (2, 1, 2, True)),
        (["topology.ranks_per_cell=8", "train.backend=megatron", "train.parallel.tensor=2",
          "train.parallel.pipeline=2"], (2, 2, 2, True)),
        (["topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.tensor=1"],
         (1, 1, 2, False)),
        (["topology.ranks_per_cell=2", "train.parallel.data=2"], (1, 1, 2, False)),
    ],
)  # fmt: skip
def test_a_cells_parallel_sizes_follow_its_backend(overrides: list[str], dims: tuple) -> None:
    """Sizes, and sequence parallelism: on by default wherever Megatron's TP > 1."""
    d = load_run_config(LOCAL, overrides).dims
    assert (d.tensor, d.pipeline, d.data, d.sequence) == dims
    assert d.ranks == d.tensor * d.pipeline * d.data


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["train.backend=jax"], "run.train.backend: 'jax' is not allowed; choose one of 'torch', 'megatron'"),
        (["topology.ranks_per_cell=2", "train.parallel.tensor=2"], "with backend torch; allowed"),
        (["topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.tensor=4"],
         "train.parallel: tensor 4 x pipeline 1 x data null != topology.ranks_per_cell 2"),
        (["topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.pipeline=2",
          "model=tiny:64x3"],
         "train.parallel.pipeline: 2 does not divide the 3 layers of model 'tiny:64x3'; "
         "allowed: a pipeline size dividing num_hidden_layers"),
        (["topology.ranks_per_cell=3", "train.backend=megatron", "train.parallel.pipeline=2"],
         "train.parallel: tensor null x pipeline 2 x data null != topology.ranks_per_cell 3"),
        (["topology.ranks_per_cell=4", "train.backend=megatron", "train.parallel.tensor=2",
          "train.parallel.data=3"],
         "train.parallel: tensor 2 x pipeline 1 x data 3 != topology.ranks_per_cell 4"),
        (["topology.ranks_per_cell=4", "train.backend=megatron", "train.parallel.data=3"],
         "train.parallel: tensor null x pipeline 1 x data 3 != topology.ranks_per_cell 4"),
        (["topology.ranks_per_cell=2", "train.parallel.data=1"],
         "train.parallel.data: 1 with backend torch and topology.ranks_per_cell 2; allowed: 2"),
        (["train.parallel.data=0"], "data: 0; allowed an integer >= 1 or null"),
        (["train.parallel.tensor=0"], "tensor: 0; allowed an integer >= 1"),
        (["train.backend=megatron", "train.parallel.tensor=1", "train.parallel.sequence=true"],
         "sequence: true with tensor 1; allowed: true with tensor > 1"),
        (["topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.pipeline=2",
          "train.parallel.sequence=true"],
         "train.parallel.sequence: true with tensor 1; allowed: true with tensor > 1"),
        (["topology.ranks_per_cell=2", "train.parallel.sequence=true"],
         "sequence True with backend torch; allowed"),
    ],
)  # fmt: skip
def test_a_parallel_layout_the_cells_cannot_hold_is_refused(overrides: list[str], says: str):
    with pytest.raises(ConfigError) as e:
        load_run_config(LOCAL, overrides)
    assert says in str(e.value)


def test_the_run_resolves_window_auto_for_its_pipeline_stages(tmp_path: Path) -> None:
    """The scheduler of a run claims windows of 2 x its training layout's pipeline stages
    (`schedule.window` auto), of 1 without a pipeline (as before windows), or the number the
    config gives; a bad value is refused naming the key."""
    path = write_config(tmp_path, small_config(tmp_path))
    assert load_run_config(path).scheduler()[0].window == 1
    pp2 = ["train.backend=megatron", "topology.ranks_per_cell=2", "train.parallel.pipeline=2"]
    assert load_run_config(path, pp2).scheduler()[0].window == 4
    assert load_run_config(path, [*pp2, "schedule.window=3"]).scheduler()[0].window == 3
    for bad, says in (("autoo", "'autoo'; allowed: an integer or 'auto'"),
                      ("0", "0; allowed: auto or an integer >= 1")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^run\.schedule\.window: {says}"):
            load_run_config(path, [f"schedule.window={bad}"])


def test_pipeline_stages_that_cannot_split_the_layers_are_refused_in_one_line(
    tmp_path: Path,
) -> None:
    from gyre.train.megatron.config import check_pipeline_split

    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", "templates/local.yaml", "model=tiny:64x3",
         "topology.ranks_per_cell=2", "train.backend=megatron", "train.parallel.pipeline=2",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "train.parallel.pipeline: 2 does not divide the 3 layers" in out.stderr
    assert not (tmp_path / "run").exists()
    model = tmp_path / "model"  # a model directory: its config.json's layer count
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 30}')
    check_pipeline_split(str(model), 3)
    with pytest.raises(ConfigError, match="4 does not divide the 30 layers"):
        check_pipeline_split(str(model), 4)


def test_render_names_both_backends_and_the_cell_layout() -> None:
    from gyre.launch.spec import job_spec, load_launch

    spec = job_spec(load_launch(ROOT / "templates" / "cluster-cpu.yaml",
                                ["train.backend=megatron"]))  # fmt: skip
    assert ("cells: train megatron (tensor 2 x pipeline 1 x data 1 per cell), engine embedded "
            "(TP 1, 1 per cell)") in spec.footprint()  # fmt: skip


def test_every_training_backend_the_config_allows_has_a_builder() -> None:
    from gyre.train.backends import BACKENDS

    for name in BACKENDS:  # each registered backend is a name the run config accepts
        assert load_run_config(LOCAL, [f"train.backend={name}"]).train_backend is BACKENDS[name]
    with pytest.raises(ConfigError) as e:  # and the config allows no other
        load_run_config(LOCAL, ["train.backend=jax"])
    assert str(e.value).endswith("choose one of " + ", ".join(repr(n) for n in BACKENDS))


def test_an_embedded_engine_on_cuda_launches_on_its_cells_gpu_and_places_the_run() -> None:
    """`engine.device: cuda` launches the embedded engine through `gyre.gpu.engine` on the GPU
    the placement gave the cell (`base_gpu_id`) in `engine.dtype`, with the embedded CLI's
    own arguments; the run then places ranks on GPUs. A device this machine lacks, or one
    not allowed, is refused before anything starts."""
    from gyre.runtime.shared.config import EngineConfig

    cmd = EngineConfig(device="cuda", dtype="float32").server("tiny", 3, base_gpu_id=2).command(0)
    assert cmd[1:7] == ["-m", "gyre.gpu.engine", "--device", "cuda:2", "--dtype", "float32"]
    assert cmd[cmd.index("--model") + 1] == "tiny" and cmd[cmd.index("--weight-version") + 1] == "3"
    assert "--max-batch-size" in cmd  # the embedded engine's own knobs follow it
    assert EngineConfig().server("tiny", 0).command(0)[1:3] == ["-m", "gyre.rollout.cli"]
    local = ROOT / "templates" / "local.yaml"
    assert load_run_config(local, ["engine.device=cuda"]).uses_gpus
    assert not load_run_config(local).uses_gpus
    with pytest.raises(ConfigError, match=r"engine\.device: 'tpu'.*allowed: device cpu \| cuda"):
        EngineConfig(device="tpu")  # type: ignore[arg-type]
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"engine\.device: cuda, but this machine has no"):
            EngineConfig(device="cuda").check_machine("tiny")


LATE_RANK = """
import sys, time
from pathlib import Path
from mpi4py import MPI
from gyre.runtime.main import exit_process
world = MPI.COMM_WORLD
world.Barrier()
if world.Get_rank() == 1:  # a rank slower to leave than its peers (a loaded machine)
    time.sleep(1.0)
    Path(sys.argv[1]).write_text("left")
exit_process(0)
"""


@pytest.mark.mpi
def test_a_rank_slower_to_leave_is_not_killed_by_mpiexec(tmp_path: Path) -> None:
    """Ranks leave through `exit_process`: mpiexec counts each as finished, so one still
    busy after its peers left finishes too and the job exits 0. A rank leaving by os._exit
    alone (no PMI finalize) made hydra SIGKILL the others: under load, finished runs failed
    with exit 9."""
    from gyre.runtime.cli import find_mpiexec

    marker = tmp_path / "late.txt"
    out = subprocess.run([find_mpiexec(), "-n", "3", sys.executable, "-c", LATE_RANK, str(marker)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert marker.read_text() == "left"
