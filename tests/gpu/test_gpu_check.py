"""tools/gpu_check.py's sections on CPU with the tiny shape: the script the GPU session runs
is exercised end to end here (engine launcher `gyre.gpu.engine`, behaviour log-probs vs the
trainer's recomputation, the rollout → training → rollout switch: what each side frees and
gets back, the Megatron TP = 2 step over two gloo processes against the torch backend). On
CPU the parity section reports itself skipped; the TP = 2 section skips itself, with the
reason, on one GPU. tools/gpu_check.sh carries a wheel for every package the sections import
beyond the device image's."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGS = argparse.Namespace(device="cpu", size="tiny")


def test_engine_logprobs_equal_trainer_recomputation(gpu_check):
    out = gpu_check.section_engine(ARGS)
    r = out["dtypes"]["float32"]
    assert out["status"] == "ok" and r["output_tokens"] == 4 * 8 and r["tokens_per_s"] > 0
    assert r["logprob_max_abs_diff"] < 1e-4  # float32 on CPU: same kernels up to rounding
    assert r["logprob_max_abs_diff_fp64_softmax"] < 1e-4


def test_role_switch_frees_each_side_and_restores_it(gpu_check):
    import torch

    out = gpu_check.section_role_switch(ARGS)
    assert out["status"] == "ok"
    for key in ("engine_release_s", "trainer_load_s", "trainer_release_s", "engine_resume_s",
                "trainer_resume_s"):  # fmt: skip
        assert isinstance(out[key], float) and math.isfinite(out[key]) and out[key] > 0, key
    # the released engine says so and refuses calls; resumed, it answers exactly as before
    assert out["engine_released"] is True and out["generate_status_while_released"] == 503
    assert out["same_output_after_switch"] is True
    # the trainer's whole float32 weight and gradient buffers: on a GPU they leave it and
    # come back (`TrainerResidency`, tests/runtime/test_placement.py moves every tensor
    # through a fake device map); on the CPU they are already on the host and stay there
    config = gpu_check.qwen_config(ARGS.size, vocab=4096)
    params = sum(p.numel() for p in gpu_check.hf_model(config, "cpu", torch.float32).parameters())
    assert out["trainer_bytes_released"] == 0
    assert out["trainer_bytes_held_after_release"] == 2 * 4 * params
    assert out["trainer_bytes_restored"] == 2 * 4 * params
    assert out["trainer_weights_restored_exactly"] is True


def test_parity_reports_skip_without_cuda(gpu_check):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on CUDA the parity section is run by tools/gpu_check.sh")
    assert gpu_check.section_parity(ARGS)["status"] == "skipped"


@pytest.mark.slow
def test_megatron_tp2_step_matches_torch_backend(gpu_check):
    """Two spawned ranks (gloo on CPU), each with its TP shard, one phase A + B step: the same
    objective, global gradient norm and (gathered) gradient tensors as the torch backend."""
    out = gpu_check.run_section("megatron_tp2", ARGS)
    assert out["status"] == "ok", out
    assert out["pass"] is True and out["tensors_compared"] == 2 + 2 * 12  # every tiny tensor
    assert out["worst_tensor_grad_rel_l2"] < 1e-5  # measured 1.0e-6


def test_megatron_tp2_skips_with_reason_on_one_gpu(gpu_check, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = gpu_check.section_megatron_tp2(argparse.Namespace(device="cuda", size="tiny"))
    assert out == {"status": "skipped", "reason": "needs 2 GPUs (NCCL, one per TP rank); 1 visible"}


def test_every_carried_import_has_a_wheel(gpu_check):
    """The device image has torch, transformers, numpy, h5py and yaml only: every other
    package the sections import is in gpu_check.sh's WHEELS, and imports here."""
    sh = (TOOL.parent / "gpu_check.sh").read_text()
    wheels = sh.split("WHEELS=(", 1)[1].split(")", 1)[0].split()
    pinned = {w.split("==")[0] for w in wheels}
    assert set(gpu_check.CARRIED.values()) <= pinned
    assert all("Error" not in v for v in gpu_check.imports().values()), gpu_check.imports()


@pytest.mark.slow
def test_the_run_section_rehearses_gyre_run_with_only_the_images_packages(gyre_check_run):
    """The GPU check's `gyre run` (Megatron, bf16, one colocated cell, 2 steps) here on the
    CPU, every process under tools/gpu_image_guard: only the device image's packages and the
    wheels tools/gpu_check.sh carries import, so a package Gyre needs and the list lacks
    fails here, not on the GPU."""
    out = gyre_check_run
    assert out["status"] == "ok", out
    assert out["steps_done"] == 2 and out["train_dtype"] == "bfloat16"
    assert out["train_backend"] == "megatron" and out["publications"] >= 1
    assert out["parks"], "no switch to rollout"
    assert out["pass"] is True, out["blocked_imports"]


@pytest.fixture(scope="module")
def gyre_check_run(gpu_check):
    return gpu_check.section_run(ARGS)


def test_the_image_guard_refuses_what_the_image_lacks(gpu_check, tmp_path):
    """The guard the rehearsal runs under: a package Gyre imports that neither the image nor
    the carried wheels provide fails as on the device (and is logged), one they provide
    imports."""
    import os
    import subprocess
    import sys

    guard = gpu_check.ROOT / "tools" / "gpu_image_guard"
    log = tmp_path / "blocked.txt"
    env = dict(os.environ, PYTHONPATH=f"{guard}{os.pathsep}{gpu_check.ROOT}",
               GYRE_IMAGE_ALLOWED="gyre,torch,tornado", GYRE_IMAGE_CHECKED="gyre",
               GYRE_IMAGE_BLOCKED=str(log))  # fmt: skip
    probe = ("import gyre.errors\n"
             "g = vars(gyre.errors)\n"
             "exec('import tornado', g)\n"
             "try:\n    exec('import h5py', g)\nexcept ModuleNotFoundError as e:\n    print(e)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "No module named 'h5py' (not on the GPU image)" in proc.stdout
    assert log.read_text().split("\n")[0] == "h5py (imported by gyre)"
