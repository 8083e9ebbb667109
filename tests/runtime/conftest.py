"""Fixtures of the runtime tests: a small run config written into a temporary directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gyre.tasks.suite import BUILTIN_DIR, LEARN_DIR

ROOT = Path(__file__).resolve().parents[2]


def small_config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """The local template, shrunk for CI (few steps, short agents)."""
    cfg = yaml.safe_load((ROOT / "templates" / "local.yaml").read_text())
    cfg["runs_dir"] = str(tmp_path / "runs")
    cfg["steps"] = 2
    cfg["harness"]["params"].update({"max_turns": "3", "max_tokens": "32"})
    cfg["timeouts"].update({"stall_s": 90, "run_s": 300, "drain_s": 40})
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


def crashing_suite(tmp_path: Path) -> Path:
    """A suite with three real tasks (one learnable) and one whose evaluator always crashes."""
    add, fizz, notes = BUILTIN_DIR / "add", BUILTIN_DIR / "fizzbuzz", LEARN_DIR / "notes"
    suite = {
        "name": "e2e",
        "defaults": {"tool_latency": {"dist": "lognormal", "mu": -2.0, "sigma": 1.0, "max_s": 2.0}},
        "tasks": [
            {"name": "add", "instruction": "Implement add(a, b) in calc.py.",
             "workspace": str(add / "workspace"),
             "scoring": {"rule": "hidden_tests", "tests": str(add / "hidden" / "test_add.py")}},
            # the slow group: its tools take 1-2.5 s each, so its executions are still live
            # while the faster groups train (a cell's rollout -> train -> rollout round trip)
            {"name": "fizzbuzz", "instruction": "Implement fizzbuzz(n) in fizzbuzz.py.",
             "tool_latency": {"dist": "uniform", "low": 1.0, "high": 2.5, "max_s": 2.5},
             "workspace": str(fizz / "workspace"),
             "scoring": {"rule": "hidden_tests",
                         "tests": str(fizz / "hidden" / "test_fizzbuzz.py")}},
            # the learnable one: its rewards differ within a group, so updates have a gradient
            {"name": "notes", "instruction": "Take notes on {focus}: one file per note, each "
             "a markdown bullet.", "variables": {"focus": ["bugs", "ideas"]},
             "workspace": str(notes / "workspace"),
             "scoring": {"rule": "command",
                         "command": ["python3", str(notes / "hidden" / "check_notes.py"),
                                     "--initial", str(notes / "workspace")]}},
            {"name": "crashy", "instruction": "Implement add(a, b) in calc.py.",
             "workspace": str(add / "workspace"),
             "scoring": {"rule": "command",
                         "command": ["python3", "-c", "raise SystemExit('evaluator bug 42')"]}},
        ],
    }  # fmt: skip
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def write_config(tmp_path: Path, cfg: dict[str, Any], name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_to_end(tmp_path: Path, cfg: dict[str, Any], name: str = "run",
               timeout: float = 400) -> Path:  # fmt: skip
    """`gyre run` of `cfg` (written beside it) into `tmp_path / name`, which it returns; the
    run must exit 0 (its output's tail is the failure message)."""
    run_dir = tmp_path / name
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", str(write_config(tmp_path, cfg, f"{name}.yaml")),
         "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return run_dir


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    return write_config(tmp_path, small_config(tmp_path))


def final_policy_loads_and_serves(policy: Path, version: int) -> None:
    """The run's product, the policy of `version`: transformers loads it (no quantization
    mark left); `gyre engine` serves it, greedy tokens the model's own."""
    import urllib.request

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    assert tok.chat_template and "tools" in tok.chat_template
    meta = json.loads((policy / "gyre-policy.json").read_text())
    assert meta["version"] == version and (policy / "model.safetensors").exists()
    assert "quantization_config" not in json.loads((policy / "config.json").read_text())
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre", "engine", "--model", str(policy), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = ""
        while "listening on" not in line:
            line = proc.stdout.readline()
            assert line, "gyre engine exited before serving the policy"
        url = line.strip().rsplit(" ", 1)[-1]
        body = json.dumps({"input_ids": list(ids), "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 4, "temperature": 0}})  # fmt: skip
        req = urllib.request.Request(url + "/generate", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    import torch

    out = reply["meta_info"]["output_token_logprobs"]
    first = out[0][1]  # greedy: the engine's first token is the model's own argmax
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0, -1]
    assert first == int(logits.argmax())
