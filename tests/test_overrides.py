"""`KEY.PATH=VALUE` overrides: YAML values, the same strict loader, and the commands using them.

`gyre sim`, `gyre render` and `gyre submit` take overrides after CONFIG; an unknown key fails
in the loader with the dotted key path and the allowed keys, exactly as in a YAML file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gyre.cli import build_parser, main
from gyre.config import apply_overrides, load, read_mapping
from gyre.errors import ConfigError
from gyre.launch.spec import load_launch
from gyre.runtime.shared.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "templates" / "local.yaml"
SIM = ROOT / "templates" / "sim" / "nl2repo.yaml"


def test_values_are_yaml_and_later_overrides_win() -> None:
    data = {"train": {"lr": 1.0e-4}, "harness": None, "name": "x"}
    out = apply_overrides(data, ["train.lr=3e-4", "harness.tasks=[add, fizzbuzz]",
                                 "harness.params.max_turns='8'", "steps=5", "steps=6",
                                 "new.flag=true", "engine.threads=", "name=a=b"])  # fmt: skip
    assert out == {
        "train": {"lr": 3e-4},
        "harness": {"tasks": ["add", "fizzbuzz"], "params": {"max_turns": "8"}},
        "name": "a=b",
        "steps": 6,
        "new": {"flag": True},
        "engine": {"threads": None},
    }
    assert isinstance(out["train"]["lr"], float)
    assert data == {"train": {"lr": 1.0e-4}, "harness": None, "name": "x"}  # not mutated
    # YAML 1.2 numbers: exponents without a dot are floats, base-60 "integers" are strings
    assert apply_overrides({}, ["x=-2.5E+2", "y=1e3", "z=1_000", "w=nan-ish", "t=2:00:00",
                                "o=007", "i=.inf"]) == {
        "x": -250.0, "y": 1000.0, "z": 1000, "w": "nan-ish", "t": "2:00:00", "o": "007",
        "i": float("inf")}  # fmt: skip


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train", "override 'train': expected KEY.PATH=VALUE"),
        ("train..lr=1", "override 'train..lr=1': expected KEY.PATH=VALUE"),
        ("=1", "expected KEY.PATH=VALUE"),
        ("steps.x=1", "override 'steps.x=1': steps is 3, not a mapping"),
        ("train.lr=[1", "override 'train.lr=[1': the value is not valid YAML"),
    ],
)
def test_malformed_overrides_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        apply_overrides({"steps": 3}, [override])


def test_run_config_through_the_strict_loader() -> None:
    data = read_mapping(LOCAL)
    cfg = load(RunConfig, apply_overrides(data, ["train.lr=3e-4", "schedule.policy=async"]),
               path="run")  # fmt: skip
    assert cfg.train.lr == 3e-4 and cfg.schedule.policy == "async"
    cases = [
        ("train.lrr=1", r"run\.train: unknown key 'lrr'; allowed keys: .*\blr\b"),
        ("trian.lr=1", r"run: unknown key 'trian'; allowed keys: .*\btrain\b"),
        ("schedule.policy=fast", r"run\.schedule\.policy: 'fast' is not allowed"),
        ("train.lr=high", r"run\.train\.lr: expected a number, got 'high'"),
        ("steps=0", r"run\.steps: 0; allowed: an integer >= 1"),
    ]
    for override, message in cases:
        with pytest.raises(ConfigError, match=message):
            load(RunConfig, apply_overrides(data, [override]), path="run")


def test_sim_takes_overrides(capsys: pytest.CaptureFixture) -> None:
    argv = ["sim", str(SIM), "scheduler.cells=4", "scheduler.nodes=16", "--policy", "elastic",
            "--steps", "2", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["policies"]["elastic"]["train_share"]) == 4  # one share per cell
    assert main(["sim", str(SIM), "scheduler.cellz=4", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "nl2repo.scheduler: unknown key 'cellz'; allowed keys: " in err and "cells" in err
    assert main(["sim", "--ablation", "E0", "steps=3"]) == 2
    assert "--ablation runs a built-in configuration; allowed without" in capsys.readouterr().err


def test_render_writes_the_merged_config_the_job_reads(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    script = tmp_path / "job.sbatch"
    argv = ["render", str(LOCAL), "train.lr=3e-4", f"runs_dir={runs}", "-o", str(script)]
    assert main(argv) == 0
    (merged,) = (runs / "configs").glob("local-*.yaml")
    assert f'GYRE_CONFIG="${{1:-${{GYRE_CONFIG:-{merged}}}}}"' in script.read_text()
    assert load(RunConfig, read_mapping(merged), path="run").train.lr == 3e-4
    expected = apply_overrides(read_mapping(LOCAL), ["train.lr=3e-4", f"runs_dir={runs}"])
    assert yaml.safe_load(merged.read_text()) == expected  # the rest of the file as it was
    assert main(argv) == 0 and len(list((runs / "configs").iterdir())) == 1  # same content
    assert main(["render", str(LOCAL), f"runs_dir={runs}", "slurm.time_limit=2:00:00"]) == 0
    plain = tmp_path / "plain.sbatch"
    assert main(["render", str(LOCAL), "-o", str(plain)]) == 0
    assert f"GYRE_CONFIG:-{LOCAL}}}" in plain.read_text()  # no overrides: the file itself


def test_submit_and_render_refuse_unknown_keys_before_writing(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    runs = tmp_path / "runs"
    assert main(["render", str(LOCAL), f"runs_dir={runs}", "slurm.tme_limit=1:00:00"]) == 2
    assert "run.slurm: unknown key 'tme_limit'; allowed keys: " in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"run\.topology: unknown key 'cellz'"):
        load_launch(LOCAL, [f"runs_dir={runs}", "topology.cellz=2"])
    assert not runs.exists()
    args = build_parser().parse_args(["submit", str(LOCAL), "topology.cells=2", "--no-follow"])
    assert args.overrides == ["topology.cells=2"]
    launch = load_launch(args.config, [*args.overrides, f"runs_dir={runs}"])
    assert launch.topology.cells == 2 and launch.path.parent == runs / "configs"


def test_run_prints_the_merged_config_and_a_dry_run_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`--print-config`: the config every rank would read (file + overrides, validated) as
    YAML that loads back to the same config; `--dry-run`: every check, the command, nothing
    written or started."""
    assert main(["run", str(LOCAL), "train.lr=3e-4", "--steps", "7", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    cfg = load(RunConfig, printed, path="run")
    assert (cfg.train.lr, cfg.steps) == (3e-4, 7)
    assert printed == yaml.safe_load(yaml.safe_dump(printed))  # plain YAML
    run_dir = tmp_path / "would-be-run"
    assert main(["run", str(LOCAL), "--dry-run", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "checks passed; would start 5 ranks" in out and "gyre.runtime.main" in out, out
    assert not run_dir.exists()
    assert main(["run", str(LOCAL), "harness.tasks=[nope]", "--dry-run"]) == 2
    assert "harness.tasks: ['nope'] not in suite 'learn'" in capsys.readouterr().err
