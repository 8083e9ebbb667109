"""The bad-input corpus: what users typed wrong, each case ending in one line naming what was
wrong and what is allowed, exit status 2, no traceback, nothing started, and every input
(model directories, the run directory a command reads or continues, config files) byte for
byte as it was.

Each case names the entry point it exercises (`CASES[i].entry`: `gyre run`, `gyre run
--resume`, `gyre eval`, `gyre report`, `gyre trace export`, `gyre render`, `gyre render
--check`, `gyre submit`, `gyre sim`, `gyre engine`, the job's first step `python -m
gyre.launch.check`); `python -m pytest tests/test_bad_input_corpus.py --collect-only -q`
lists them, grouped by entry point in their ids. They run in-process (`gyre.cli.main`, what
`python -m gyre` runs; `gyre.launch.check.main` for the in-job check), so the corpus costs
seconds, and a command that starts work instead of refusing trips a 60 s alarm. Cases that
need a process of their own (a full disk, a read-only directory, a real evaluation) are in
tests/test_data_safety.py and tests/test_preflight_corpus.py.

The inputs are built as the runtime writes them, not run: tiny model directories (config +
tokenizer from transformers' `save_pretrained`: families and shapes the ranks refuse), and
the `resumable_run` directory of tests/conftest.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gyre.cli import main as gyre_main
from gyre.launch.check import main as in_job_main

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "templates" / "local.yaml"
CLUSTER_CPU = ROOT / "templates" / "cluster-cpu.yaml"


@dataclass(frozen=True)
class Case:
    entry: str
    """The entry point this case exercises (its first words as a user types them)."""
    argv: tuple[str, ...]
    """Its arguments after `gyre` ({run}, {models}, {tmp}, {local}, {cluster} filled in)."""
    says: tuple[str, ...]
    """What the one line must contain."""
    no_slurm: bool = False
    """Run with a PATH holding no Slurm commands (a laptop, or CI before its Slurm starts)."""
    config: dict | None = None
    """Sections of a config file written to {tmp}/case.yaml from {local} (or `base`)."""
    base: str = "local"


RUN, MODELS = "{run}", "{models}"
CASES: list[Case] = [
    # ---- gyre run: the model against the backends and this machine -----------------------
    Case("gyre run", ("run", "{local}", f"model={MODELS}/small_vocab", "--dry-run"),
         ("model:", "vocab_size 1000", "4096", "allowed")),
    Case("gyre run", ("run", "{local}", f"model={MODELS}/mistral", "--dry-run"),
         ("model:", "engine.backend embedded", "sliding", "allowed")),
    Case("gyre run", ("run", "{tmp}/case.yaml", "--dry-run"),
         ("train.backend megatron", "model_type: 'olmo2'", "allowed"),
         config={"model": f"{MODELS}/olmo2", "train": {"backend": "megatron"}}),
    Case("gyre run", ("run", "{tmp}/case.yaml", "--dry-run"),
         ("train.backend megatron", "model_type: 'mistral'", "allowed"),
         config={"model": f"{MODELS}/mistral", "train": {"backend": "megatron"}}),
    Case("gyre run", ("run", "{local}", "train.routing_replay=3", "--dry-run"),
         ("train.routing_replay: 3", "allowed: true / false or 'auto'")),
    Case("gyre run", ("run", "{tmp}/case.yaml", "--dry-run"),
         ("train.routing_replay: true", "routes no experts", "allowed: true for a mixture"),
         config={"model": f"{MODELS}/qwen2_dense", "train": {"routing_replay": True}}),
    Case("gyre run", ("run", "{local}", "model=/tmp/gyre-no-such-model", "--dry-run"),
         ("neither a known model nor a directory", "allowed: tiny")),
    Case("gyre run", ("run", "{local}", f"model={MODELS}/no_tokenizer", "--dry-run"),
         ("has no tokenizer",)),
    Case("gyre run", ("run", "{local}", "model={tmp}", "--dry-run"), ("has no config.json",)),
    Case("gyre run", ("run", "{tmp}"), ("is a directory", "allowed: a YAML file")),
    Case("gyre run", ("run", "{local}", "train.device=cuda", "topology.cells=9", "--dry-run"),
         ("train.device", "cuda")),
    Case("gyre run", ("run", "{local}", "train.backend=megatron", "topology.ranks_per_cell=2",
                      "train.parallel.expert=3", "--dry-run"),
         ("train.parallel.expert: 3 does not divide tensor 2", "allowed: a divisor of tensor 2")),
    Case("gyre run", ("run", "{local}", "train.backend=megatron", "topology.ranks_per_cell=2",
                      "train.parallel.expert=2", "--dry-run"),
         ("expert_parallel: 2 for a qwen2 model", "no routed experts", "allowed: 1")),
    Case("gyre run", ("run", "{local}", f"model={MODELS}/qwen3_moe_5", "train.backend=megatron",
                      "topology.ranks_per_cell=2", "train.parallel.expert=2", "--dry-run"),
         ("expert_parallel: 2 does not divide the 5 routed experts", "allowed: a divisor")),
    Case("gyre run", ("run", "{local}", "train.backend=megatron", "topology.ranks_per_cell=4",
                      "train.parallel.tensor=2", "train.parallel.data=3", "--dry-run"),
         ("train.parallel: tensor 2 x pipeline 1 x data 3 != topology.ranks_per_cell 4",
          "allowed: tensor x pipeline x data = ranks_per_cell")),
    Case("gyre run", ("run", "{local}", "topology.ranks_per_cell=2", "train.parallel.data=4",
                      "--dry-run"),
         ("train.parallel.data: 4 with backend torch", "allowed: 2 or null")),
    Case("gyre run", ("run", "{local}", "topology.ranks_per_cell=2", "train.parallel.expert=2",
                      "--dry-run"),
         ("expert 2", "with backend torch", "allowed:", "expert 1")),
    Case("gyre run", ("run", "{local}", "engine.expert_parallel=2", "--dry-run"),
         ("engine.expert_parallel: 2 with engine.backend embedded", "allowed: 1")),
    Case("gyre run", ("run", "{local}", "engine.backend=sglang", "engine.tensor_parallel=4",
                      "engine.expert_parallel=3", "--dry-run"),
         ("engine.expert_parallel: 3", "a divisor of engine.tensor_parallel 4")),
    Case("gyre run", ("run", "{local}", "engine.per_cell=3", "topology.ranks_per_cell=2",
                      "--dry-run"),
         ("engine.per_cell: 3 engines", "topology.ranks_per_cell 2", "allowed: at most 2")),
    Case("gyre run", ("run", "{local}", "engine.per_cell=0", "--dry-run"),
         ("engine.per_cell: 0", "allowed: auto or an integer >= 1")),
    Case("gyre run", ("run", "{local}", "engine.nodes=2", "--dry-run"),
         ("engine.nodes: 2 with engine.backend embedded", "allowed: 1")),
    Case("gyre run", ("run", "{local}", "engine.per_cell=3", "topology.ranks_per_cell=3",
                      "--dry-run"),
         ("concurrency_per_cell: 4 does not split over 3 engines", "a multiple of 3")),
    Case("gyre run", ("run", "{local}", "schedule.window=autoo", "--dry-run"),
         ("schedule.window: 'autoo'", "allowed: an integer or 'auto'")),
    Case("gyre run", ("run", "{local}", "schedule.window=0", "--dry-run"),
         ("schedule.window: 0", "allowed: auto or an integer >= 1")),
    Case("gyre run", ("run", "{local}", "schedule.window=1.5", "--dry-run"),
         ("schedule.window: 1.5", "allowed: an integer or 'auto'")),
    # ---- gyre run: harness, trackers, the run directory ------------------------------------
    Case("gyre run", ("run", "{local}", "harness.params.max_turns=lots", "--dry-run"),
         ("harness.params.max_turns: 'lots'", "allowed: an integer >= 0", "adapter 'reference'")),
    Case("gyre run", ("run", "{local}", "harness.params.delegate=maybe", "--dry-run"),
         ("harness.params.delegate: 'maybe'", "allowed: one of")),
    Case("gyre run", ("run", "{local}", "harness.params.nope=1", "--dry-run"),
         ("unknown parameter 'nope'", "allowed:")),
    Case("gyre run", ("run", "{tmp}/case.yaml", "--dry-run"),
         ("tracking.mlflow.tracking_uri: 'htp://mlflow:5000'", "allowed"),
         config={"tracking": {"mlflow": {"enabled": True, "tracking_uri": "htp://mlflow:5000"}}}),
    Case("gyre run", ("run", "{local}", "runs_dir=/sys/gyre-runs", "--dry-run"),
         ("run directory: /sys/gyre-runs/", "allowed", "runs_dir=")),
    Case("gyre run", ("run", "--dry-run", "--run-dir", "/proc/gyre-no-dir"),
         ("--run-dir", "/proc", "cannot make a directory")),
    Case("gyre run", ("run", "{local}", f"model={RUN}/policies/final", "--run-dir", RUN,
                      "--dry-run"),
         ("run directory", "contains the model", "does not write over")),
    Case("gyre run", ("run", "{local}", "harness.tasks=[add]", "--dry-run"),
         ("harness.tasks", "not in suite 'learn'", "allowed: notes")),
    Case("gyre run", ("run", "{local}", "--steps", "2", "train.bogus=1"),
         ("unknown key 'bogus'",)),
    Case("gyre run", ("run", "{local}", "train.dtype=float16", "--dry-run"),
         ("train.dtype", "'float16'", "'auto', 'float32', 'bfloat16'")),
    Case("gyre run", ("run", "{tmp}/case.yaml", "--run-dir", RUN),
         ("--run-dir", "holds a run of another config", "gyre run --resume"),
         config={"train": {"lr": 0.01}}),
    Case("gyre run", ("run", "{tmp}/case.yaml", "--run-dir", "{tmp}", "--dry-run"),
         ("run directory", "contains the config", "does not write over"), config={}),
    # ---- gyre run --resume ------------------------------------------------------------------
    Case("gyre run --resume", ("run", "--resume", RUN, "model=tiny:128x2"),
         ("model: 'tiny:128x2' (hidden_size 128, the run's 64)", "allowed: 'tiny'")),
    Case("gyre run --resume", ("run", "--resume", RUN, "--steps", "3"),
         ("steps: 3, but the run has done 4 updates", "allowed: steps >= 4")),
    Case("gyre run --resume", ("run", "--resume", RUN, "schedule.group_size=2"),
         ("schedule.group_size + schedule.oversample: 2", "g8 has 4", "allowed: 4")),
    Case("gyre run --resume", ("run", "--resume", RUN, "train.bogus=1"),
         ("unknown key 'bogus'",)),
    Case("gyre run --resume", ("run", "{tmp}/case.yaml", "--resume", RUN),
         ("--resume", "with CONFIG", "allowed: gyre run --resume"), config={"train": {"lr": 0.01}}),
    Case("gyre run --resume", ("run", "--resume", RUN, "--run-dir", "{tmp}/elsewhere"),
         ("give one run directory",)),
    Case("gyre run --resume", ("run", "--resume", "{tmp}"), ("is not a run directory",)),
    Case("gyre run --resume", ("run", "--resume", RUN, f"model={RUN}/policies/final"),
         ("contains the model", "does not write over")),
    # ---- gyre eval ------------------------------------------------------------------------
    Case("gyre eval", ("eval", RUN, "--out", f"{RUN}/policies", "--instances", "1"),
         ("--out", "does not write over")),
    Case("gyre eval", ("eval", RUN, "--out", RUN, "--instances", "1"),
         ("--out", "does not write over")),
    Case("gyre eval", ("eval", f"{RUN}/policies/final", "--out", f"{RUN}/policies/final/x"),
         ("--out", "does not write over")),
    Case("gyre eval", ("eval", "tiny", "--out", "/proc/gyre-no-dir"),
         ("--out", "/proc", "cannot make a directory")),
    Case("gyre eval", ("eval", "tiny", "--tasks", "nope"),
         ("--tasks: ['nope'] not in suite 'learn'", "allowed: notes")),
    Case("gyre eval", ("eval", "tiny", "harness.suite=builtin", "harness.tasks=[add]"),
         ("task(s) add have no variables", "allowed: eval.suite=")),
    # ---- gyre report, gyre trace ----------------------------------------------------------
    Case("gyre report", ("report", RUN, "--out", RUN), ("--out", "does not write over")),
    Case("gyre report", ("report", "x", "--out", "/proc/gyre-no-dir"),
         ("--out", "/proc", "cannot make a directory")),
    Case("gyre trace export", ("trace", "export", RUN, "--out", RUN),
         ("contains the trace", "does not write over")),
    Case("gyre trace export", ("trace", "export", f"{RUN}/trace.h5", "--out", RUN),
         ("contains the trace", "does not write over")),
    Case("gyre trace show", ("trace", "show", "{tmp}"), ("trace.h5",)),
    # ---- the cluster's entry points -------------------------------------------------------
    Case("gyre render", ("render", "{tmp}/case.yaml"),
         ("train.backend megatron", "model_type: 'olmo2'"),
         config={"model": f"{MODELS}/olmo2", "train": {"backend": "megatron"}},
         no_slurm=True),
    Case("gyre render", ("render", "{tmp}/case.yaml"),
         ("engine.expert_parallel: 2", "qwen2_dense", "no routed experts", "allowed: 1"),
         config={"model": f"{MODELS}/qwen2_dense",
                 "engine": {"backend": "sglang", "tensor_parallel": 2, "expert_parallel": 2},
                 "slurm": {"gpus_per_node": 4}},
         no_slurm=True),
    Case("gyre render", ("render", "{tmp}/case.yaml"),
         ("engine.expert_parallel: 4", "6 routed experts", "a divisor of its expert count"),
         config={"model": f"{MODELS}/qwen3_moe",
                 "engine": {"backend": "sglang", "tensor_parallel": 4, "expert_parallel": 4},
                 "slurm": {"gpus_per_node": 4}},
         no_slurm=True),
    Case("gyre render", ("render", "{tmp}/case.yaml"),
         ("engine.nodes 2: node ranks 0 and 1 of a cell's engine 0", "fall on one node",
          "allowed: engine.tensor_parallel 4 (the ranks of one node) with engine.nodes > 1"),
         config={"model": f"{MODELS}/qwen2_dense",
                 "engine": {"backend": "sglang", "tensor_parallel": 2, "nodes": 2},
                 "topology": {"cells": 3, "ranks_per_cell": 4}, "slurm": {"gpus_per_node": 4}},
         no_slurm=True),
    Case("gyre render", ("render", "{tmp}/case.yaml"),
         ("slurm.gpus_per_node 4", "its 4 trainer ranks and 2 engines", "needs 8",
          "fewer ranks or engines on the node (engine.per_cell)"),
         config={"model": f"{MODELS}/qwen2_dense",
                 "engine": {"backend": "sglang", "tensor_parallel": 2, "per_cell": 2},
                 "topology": {"cells": 3, "ranks_per_cell": 4, "placement": "disjoint"},
                 "slurm": {"gpus_per_node": 4}},
         no_slurm=True),
    Case("gyre render", ("render", "{local}", "harness.params.delegate=maybe"),
         ("harness.params.delegate: 'maybe'", "adapter 'reference'")),
    Case("gyre render", ("render", "{tmp}/case.yaml"), ("tracking.mlflow.tracking_uri",),
         config={"tracking": {"mlflow": {"enabled": True, "tracking_uri": "htp://mlflow:5000"}}}),
    Case("gyre render --check", ("render", "{tmp}/case.yaml", "--check"),
         ("train.backend megatron", "model_type: 'olmo2'"),
         config={"model": f"{MODELS}/olmo2", "train": {"backend": "megatron"}},
         no_slurm=True),
    Case("gyre render --check", ("render", "{tmp}/case.yaml", "--check"),
         ("slurm.log_dir: '/nonexistent-gyre-logs'", "allowed"),
         config={"slurm": {"log_dir": "/nonexistent-gyre-logs"}}, base="cluster"),
    Case("gyre submit", ("submit", "{tmp}/case.yaml", "--folder", "{tmp}/s"),
         ("train.backend megatron", "model_type: 'mistral'"),
         config={"model": f"{MODELS}/mistral", "train": {"backend": "megatron"}}, no_slurm=True),
    Case("gyre submit", ("submit", "{tmp}/case.yaml", "--folder", "{tmp}/s"),
         ("slurm.log_dir: '/nonexistent-gyre-logs'", "allowed"),
         config={"slurm": {"log_dir": "/nonexistent-gyre-logs"}}, base="cluster"),
    Case("gyre submit", ("submit", "{local}", "--folder", "{tmp}/s"), ("scontrol not found",),
         no_slurm=True),
    Case("in-job check", ("{tmp}/case.yaml",),
         ("train.backend megatron", "model_type: 'olmo2'"),
         config={"model": f"{MODELS}/olmo2", "train": {"backend": "megatron"}}),
    # ---- the other commands ---------------------------------------------------------------
    Case("gyre sim", ("sim", "{local}"), ("is a run config", "templates/sim/nl2repo.yaml")),
    Case("gyre sim", ("sim", "templates/sim/nl2repo.yaml", "--sweep", "concurrency_per_cell"),
         ("allowed KEY=V1,V2",)),
    Case("gyre engine", ("engine", "--model", "/tmp/gyre-no-such-model"),
         ("neither a known model",)),
    Case("gyre plan", ("plan", "--staleness", "-1"), ("--staleness",)),
]  # fmt: skip


def digest(root: Path) -> dict[str, str]:
    """Every file under `root` -> the hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny model directories (config + tokenizer): families and shapes the ranks refuse."""
    from transformers import AutoConfig

    from gyre.models import tiny_tokenizer

    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer()
    sizes = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": len(tok)}  # fmt: skip
    for name, family, extra in [
        ("olmo2", "olmo2", {"pad_token_id": 0, "eos_token_id": 1}),  # not a family Megatron maps
        ("mistral", "mistral", {}),  # sliding_window 4096: not batchable by the embedded engine
        ("small_vocab", "qwen2", {"vocab_size": 1000}),  # < the tokenizer's 4096 tokens
        ("no_tokenizer", "qwen2", {}),
        ("qwen2_dense", "qwen2", {}),  # no experts to split over engine.expert_parallel GPUs
        (
            "qwen3_moe",
            "qwen3_moe",
            {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        ),  # 6 experts: not over 4
        (
            "qwen3_moe_5",
            "qwen3_moe",
            {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        ),  # 5 experts: not over train.parallel.expert 2
    ]:
        AutoConfig.for_model(family, **{**sizes, **extra}).save_pretrained(root / name)
        if name != "no_tokenizer":
            tok.save_pretrained(root / name)
    return root


@pytest.fixture
def alarm() -> Iterator[None]:
    def fire(*_: object) -> None:
        raise AssertionError("still running after 60 s: it started work on a bad input")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _fill(text: str, where: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in where.items()})


def _config_file(case: Case, where: dict[str, Path]) -> None:
    assert case.config is not None
    data = yaml.safe_load((LOCAL if case.base == "local" else CLUSTER_CPU).read_text())
    data["runs_dir"] = str(where["tmp"] / "runs")
    for key, value in case.config.items():
        value = _fill(value, where) if isinstance(value, str) else value
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    (where["tmp"] / "case.yaml").write_text(yaml.safe_dump(data))


@pytest.mark.parametrize("case", CASES, ids=[f"{c.entry}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_input_is_one_line_exit_2_and_changes_nothing(
    case: Case, models: Path, resumable_run: Path, tmp_path: Path, alarm: None,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    run = Path(shutil.copytree(resumable_run, tmp_path / "runs" / resumable_run.name))
    case_dir = tmp_path / "case"
    case_dir.mkdir()
    where = {"run": run, "models": models, "tmp": case_dir, "local": LOCAL,
             "cluster": CLUSTER_CPU}  # fmt: skip
    if case.config is not None:
        _config_file(case, where)
    if case.no_slurm:
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sinfo / scontrol
    monkeypatch.chdir(ROOT)
    inputs = {"run": digest(run), "models": digest(models), "case": digest(case_dir)}
    argv = [_fill(a, where) for a in case.argv]
    rc = in_job_main(argv) if case.entry == "in-job check" else gyre_main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (argv, rc, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("gyre"), (argv, err[-2000:])
    assert "Traceback" not in err and all(s in lines[0] for s in case.says), (argv, lines[0])
    after = {"run": digest(run), "models": digest(models), "case": digest(case_dir)}
    assert after == inputs, f"{argv}: an input changed"
    assert not (case_dir / "runs").exists() and not (case_dir / "s").exists(), "it wrote a run"
    assert not os.path.exists(ROOT / "runs" / "gyre-no-such")
