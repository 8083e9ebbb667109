"""Start-up cuts (docs/runtime.md "Start-up"), each still doing what it replaced.

* The ranks that move no tensors never import torch: on a machine with few cores every
  rank's imports compete with the cells' model build, the start's critical path (torch is
  ~1.1 CPU-s a process). The coordinator (it computes the execution gates,
  `gyre.train.scalars`) and the proxy node build their roles without it.
* A harness agent (a dozen start at once in a default run's first group) imports neither
  YAML nor the suite code: the tool latency it applies is `gyre.tasks.latency`, the same
  class the suite loads.
* A Megatron rank imports megatron-core without wandb and, on a CPU-only torch, without the
  `torch.compile` machinery its fused functions would import (~1.2 CPU-s a rank zygote).
* `gyre run`'s model check of a shipped tiny model under Megatron (transformers and torch
  imported before any rank starts) is remembered once passed, keyed by all it depends on;
  a refusal is never remembered.
* A SmolLM2 run on an empty cache converts the GGUF file once, not in every cell and engine
  at once (48 → 17 s of model build, three cells on two cores).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from gyre.errors import ConfigError
from gyre.runtime import preflight
from gyre.runtime.shared.checks import Where
from gyre.runtime.shared.config import DEFAULT_CONFIG, load_run_config


@pytest.mark.parametrize("module", ["gyre.runtime.coordinator.coordinator",
                                    "gyre.runtime.proxy_node.node"])  # fmt: skip
def test_a_rank_that_moves_no_tensors_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} imports torch: {out.stdout}"


def test_a_harness_agent_imports_neither_yaml_nor_the_suite() -> None:
    code = ("import sys, gyre.harness.reference_agent; "
            "print(sorted(m for m in sys.modules if m.startswith(('yaml', 'gyre.tasks.suite'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the reference agent imports {out.stdout}"


def test_the_suite_and_the_agent_apply_one_tool_latency() -> None:
    from gyre.harness import reference_agent, tools
    from gyre.tasks import latency, suite

    assert suite.ToolLatency is latency.ToolLatency is tools.ToolLatency
    assert reference_agent.ToolLatency is latency.ToolLatency


def test_the_objective_still_offers_the_execution_scalars() -> None:
    from gyre.train import objective, scalars

    assert objective.execution_scalars is scalars.execution_scalars
    assert objective.ExecutionScalar is scalars.ExecutionScalar


def test_a_megatron_rank_zygote_imports_neither_wandb_nor_torch_compile_machinery() -> None:
    """`gyre run`'s rank zygote for Megatron cells, on this CPU-only torch: megatron-core
    imported as a rank imports it (`import_megatron`), its fused functions eager, wandb
    importable afterwards."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (gyre[gpu])")
    code = ("import sys, torch, gyre.runtime.main as m; m.preload('megatron'); "
            "from megatron.core.transformer import utils; "
            "print(sorted(n for n in sys.modules if n.startswith(('wandb', 'torch._inductor.compile_fx')))[:3]); "
            "print(hasattr(utils.gelu_impl, '_torchdynamo_orig_callable'), torch.compile.__module__); "
            "import wandb")  # fmt: skip
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    imported, fused = out.stdout.strip().splitlines()
    assert imported == "[]", f"the Megatron rank zygote imports {imported}"
    assert fused == "False torch", fused  # a fused function eager; torch.compile torch's own


def _megatron(ranks: int):  # type: ignore[no-untyped-def]
    return load_run_config(DEFAULT_CONFIG, ["train.backend=megatron",
                                            f"topology.ranks_per_cell={ranks}"])  # fmt: skip


def test_a_passed_tiny_model_check_is_remembered_per_layout(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("megatron.core", reason="megatron-core not installed (gyre[gpu])")
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    import gyre.models

    real = gyre.models.model_config
    monkeypatch.setattr(gyre.models, "model_config", lambda m: calls.append(m) or real(m))
    two = _megatron(2)
    assert preflight._model(two, Where.HERE) == [] and calls == ["tiny"]
    assert preflight._model(two, Where.HERE) == [] and calls == ["tiny"]  # remembered
    assert len(list((tmp_path / "checks").iterdir())) == 1
    assert preflight._model(_megatron(1), Where.HERE) == []  # another layout: checked
    assert calls == ["tiny", "tiny"]


def test_a_refused_model_check_is_refused_every_time(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("megatron.core", reason="megatron-core not installed (gyre[gpu])")
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path))
    for _ in range(2):
        with pytest.raises(ConfigError, match="not divisible by tensor_parallel 4"):
            preflight._model(_megatron(4), Where.HERE)
    assert not (tmp_path / "checks").exists()


CONVERT = """
import sys, time
from pathlib import Path
from gyre.models import _one_converts
cache = Path(sys.argv[1])
with _one_converts(cache):
    if cache.exists():
        print("read the cache")
        sys.exit(0)
    print("converting", flush=True)
    time.sleep(1.0)
    cache.mkdir()
"""


def test_a_model_is_converted_once_while_the_other_processes_wait(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A run starting on an empty cache loads SmolLM2 in every cell and engine at once: the
    first process converts it, the others wait and read its result (`gyre.models`)."""
    cache = tmp_path / "cache" / "smollm2-135m-model-1"
    first = subprocess.Popen([sys.executable, "-c", CONVERT, str(cache)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert first.stdout is not None and first.stdout.readline() == "converting\n"
        second = subprocess.run([sys.executable, "-c", CONVERT, str(cache)],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (second.returncode, second.stdout) == (0, "read the cache\n"), second.stderr
    finally:
        first.wait(timeout=60)
    assert first.returncode == 0
