"""GPU check of Gyre's CUDA paths: one JSON file with every number the issue asks for.

    python tools/gpu_check.py --out $OUT/gpu_check.json            # on the H200 (≤ 8 min)
    python tools/gpu_check.py --device cpu --size tiny --out x.json # the CPU smoke run (tests)

Sections, each in its own subprocess with its own timeout (a hang or crash in one is
recorded and the next still runs):

* ``parity``      — torch backend (transformers Qwen2) and Megatron backend (GPTModel, weights
  mapped by `gyre.train.megatron.weights`) on the same random-init Qwen2-style model and the
  same batch: objective value, gradient norm, and per-tensor gradient differences, in
  float32 and bfloat16 (tolerances in TOLERANCES);
* ``train_speed`` — tokens/s of a phase-B micro-step (forward + backward) and of a phase-A
  prepass, bf16, for each backend;
* ``engine``      — the embedded engine on CUDA (`python -m gyre.gpu.engine`): `/generate`
  tokens/s with concurrent calls, and behaviour log-probs vs the trainer's recomputed
  log-probs on the same weights (max abs difference), per dtype;
* ``role_switch`` — rollout → training → rollout → training on one GPU: seconds and device
  memory at every point (engine release, trainer load + one micro-step, trainer release,
  engine resume, trainer resume); that the released engine says so and refuses calls (503),
  the bytes the trainer's buffers gave back and still hold, whether the engine answers
  identically afterwards and the trainer gets its exact weights back;
* ``megatron_tp2`` — a Megatron cell with tensor parallelism 2: two processes
  (`torch.multiprocessing.spawn`; NCCL, one GPU each, or gloo on CPU with the CPU patches
  of `gyre.train.megatron.cpu`) load their TP shards of the model (`hf_to_mcore`) and run
  one phase-A + phase-B step in float32; objective, global gradient norm and every
  gathered gradient tensor against the one-process torch backend. Skipped, with the reason,
  on a machine with fewer than two GPUs.

The model is built from a config (nothing is downloaded): ``--size 0.5b`` is Qwen2.5-0.5B's
shape (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151936, tied); the
engine sections use the same shape with the shipped 4096-token tokenizer's vocabulary.
`meta.imports` lists the version of every third-party package the sections import beyond
torch / transformers / numpy / h5py / yaml (tools/gpu_check.sh carries their wheels), or why
it failed to import.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
}  # fmt: skip
TOLERANCES = {
    "float32": {"objective_rel": 1e-4, "grad_norm_rel": 1e-4},
    "bfloat16": {"objective_rel": 3e-2, "grad_norm_rel": 3e-2},
}
SECTIONS = ("run", "parity", "train_speed", "engine", "role_switch", "megatron_tp2")
BUDGET_S = {"run": 150, "parity": 100, "train_speed": 60, "engine": 80, "role_switch": 60,
            "megatron_tp2": 100}  # fmt: skip
# The device image's own packages (what tools/gpu_check.sh does not carry).
IMAGE = ("torch", "transformers", "numpy", "h5py", "pyyaml")
# Imported by the sections (directly or through gyre: `gyre run`'s ranks and engines too)
# beyond the image's: tools/gpu_check.sh's WHEELS carries them, and the CPU rehearsal of the
# `run` section allows exactly these (tools/gpu_image_guard) — a missing one fails it here.
CARRIED = {"megatron.core": "megatron-core", "tornado": "tornado", "orjson": "orjson",
           "aiohttp": "aiohttp", "mpi4py": "mpi4py", "psutil": "psutil",
           "llguidance": "llguidance", "prometheus_client": "prometheus-client"}  # fmt: skip
# Gyre's optional packages, used where installed and absent on the image (the run goes on
# without them: mooncake is the RDMA transport, `train.transport: mooncake`)
OPTIONAL = ("mooncake",)
# the carried packages' own dependencies (no module of their own to check: their wheels)
CARRIED_DEPENDENCIES = ("aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict",
                        "propcache", "yarl", "idna", "mpich")  # fmt: skip


# ----- shared helpers ---------------------------------------------------------------------
def qwen_config(size: str, *, vocab: int | None = None) -> Any:
    from transformers import Qwen2Config

    spec = dict(SIZES[size])
    if vocab is not None:
        spec["vocab_size"] = vocab
    return Qwen2Config(
        **spec, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02, attn_implementation="sdpa",
    )  # fmt: skip


def hf_model(config: Any, device: str, dtype: Any) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialize where it will run (fast on a GPU)
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=dtype).eval()


def batch(vocab: int, *, executions: int, length: tuple[int, int], budget: int, seed: int = 0):
    import numpy as np

    from gyre.train.packing import pack_rows
    from gyre.train.synthetic import random_batch

    rows, info = random_batch(
        np.random.default_rng(seed), executions=executions, vocab=vocab, length=length,
        behaviour_centre=-math.log(vocab), rows_per_execution=(1, 2),
    )  # fmt: skip
    return pack_rows(rows, token_budget=budget), info


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_batch(cell: Any, steps: list, info: Any) -> dict[str, Any]:
    """Phase A, scalars, phase B over `steps` on one cell: objective and gradient norm."""
    from gyre.train.config import ObjectiveConfig
    from gyre.train.objective import execution_scalars, merge_sums

    obj = ObjectiveConfig()
    sums = merge_sums([cell.prepass(s) for s in steps])
    scalars = execution_scalars(sums, info.executions, obj)
    cell.zero_grad()
    done = [cell.accumulate(s, scalars) for s in steps]
    return {
        "objective": sum(d.objective for d in done),
        "grad_norm": float(cell.flat_grads.double().norm()) / info.num_executions,
        "log_ratio_sum": sum(sums.values()),
    }


def megatron_world(device: str) -> None:
    import torch.distributed as dist

    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import init_model_parallel

    if not dist.is_initialized():  # a world of one: an in-process store, no port
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(MegatronConfig(), device)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ----- (a) parity -------------------------------------------------------------------------
def section_parity(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gyre.train.cell import TorchCell
    from gyre.train.config import ObjectiveConfig
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_gpt_model
    from gyre.train.megatron.weights import WeightLayout, hf_to_mcore, mcore_to_hf

    if not args.device.startswith("cuda"):
        return {"status": "skipped", "reason": "megatron-core forward/backward needs CUDA"}
    megatron_world(args.device)
    config = qwen_config(args.size)
    hfc = config.to_dict()
    layout = WeightLayout.from_hf_config(hfc)
    steps, info = batch(config.vocab_size, executions=6, length=(64, 384), budget=2048)
    out: dict[str, Any] = {"params": None, "micro_steps": len(steps), "dtypes": {}}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        ref = hf_model(config, args.device, dtype)
        out["params"] = sum(p.numel() for p in ref.parameters())
        meg = build_gpt_model(hfc, MegatronConfig(dtype=name), device=args.device)
        load = meg.load_state_dict(hf_to_mcore(ref.state_dict(), layout), strict=False)
        assert not load.unexpected_keys, load.unexpected_keys
        tcell = TorchCell(ref, objective=ObjectiveConfig())
        mcell = MegatronCell(meg, objective=ObjectiveConfig())
        a, b = run_batch(tcell, steps, info), run_batch(mcell, steps, info)
        hf_grads = {k: p.grad for k, p in ref.named_parameters()}
        mg = mcore_to_hf([{k: p.grad for k, p in meg.named_parameters()}], layout)
        worst = max(
            float((mg[k].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30))
            for k, g in hf_grads.items() if k in mg
        )  # fmt: skip
        tol = TOLERANCES[name]
        out["dtypes"][name] = {
            "torch": a, "megatron": b,
            "objective_rel_diff": rel(b["objective"], a["objective"]),
            "grad_norm_rel_diff": rel(b["grad_norm"], a["grad_norm"]),
            "worst_tensor_grad_rel_l2": worst, "tolerance": tol,
            "pass": rel(b["objective"], a["objective"]) <= tol["objective_rel"]
            and rel(b["grad_norm"], a["grad_norm"]) <= tol["grad_norm_rel"],
        }  # fmt: skip
        del tcell, mcell, ref, meg
        torch.cuda.empty_cache()
    out["status"] = "ok"
    return out


# ----- (b) training speed -----------------------------------------------------------------
def time_steps(cell: Any, step: Any, scalars: Any, n: int, device: str) -> dict[str, float]:
    for _ in range(2):
        cell.accumulate(step, scalars)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        cell.accumulate(step, scalars)
    sync(device)
    fb = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        cell.prepass(step)
    sync(device)
    fw = (time.perf_counter() - t0) / n
    tokens = step.padded_tokens
    return {"tokens": tokens, "fwd_bwd_s": fb, "fwd_bwd_tokens_per_s": tokens / fb,
            "prepass_s": fw, "prepass_tokens_per_s": tokens / fw}  # fmt: skip


def section_train_speed(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gyre.train.cell import TorchCell
    from gyre.train.config import ObjectiveConfig
    from gyre.train.objective import ExecutionScalar

    cuda = args.device.startswith("cuda")
    config = qwen_config(args.size)
    rows, length = (8, 2048) if cuda else (2, 32)
    steps, _ = batch(config.vocab_size, executions=rows, length=(length, length),
                     budget=rows * length)  # fmt: skip
    step = steps[0]
    scalars = {r.execution_id: ExecutionScalar(advantage=1.0, num_targets=r.num_targets,
                                               log_ratio=0.0, gate=1.0) for r in step.rows}  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    n = 5 if cuda else 1
    out: dict[str, Any] = {"dtype": str(dtype), "rows": len(step.rows), "row_length": length}
    cell = TorchCell(hf_model(config, args.device, dtype), objective=ObjectiveConfig())
    out["torch"] = time_steps(cell, step, scalars, n, args.device)
    if cuda:
        from gyre.train.megatron.config import MegatronConfig
        from gyre.train.megatron.model import MegatronCell, build_gpt_model
        from gyre.train.megatron.weights import WeightLayout, hf_to_mcore

        megatron_world(args.device)
        meg = build_gpt_model(config.to_dict(), MegatronConfig(dtype="bfloat16"), device="cuda")
        # built uninitialized: the torch model's weights
        meg.load_state_dict(
            hf_to_mcore(cell.model.state_dict(), WeightLayout.from_hf_config(config.to_dict())),
            strict=False,
        )
        del cell
        torch.cuda.empty_cache()
        out["megatron"] = time_steps(MegatronCell(meg, objective=ObjectiveConfig()), step,
                                     scalars, n, args.device)  # fmt: skip
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    else:
        out["megatron"] = {"status": "skipped", "reason": "needs CUDA"}
    out["status"] = "ok"
    return out


# ----- (c) embedded engine on CUDA --------------------------------------------------------
def engine_model_dir(args: argparse.Namespace, where: Path) -> Path:
    import shutil

    from gyre.models import TINY_TOKENIZER_DIR

    config = qwen_config(args.size, vocab=4096)
    model = hf_model(config, "cpu", __import__("torch").float32)
    model.save_pretrained(where)
    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, where / f.name)
    return where


def start_engine(args: argparse.Namespace, model_dir: Path, dtype: str) -> Any:
    from gyre.rollout.serving.config import ServerConfig
    from gyre.rollout.serving.process import EngineProcess

    launch = ["{python}", "-m", "gyre.gpu.engine", "--device", args.device, "--dtype", dtype,
              "--model", "{model_path}", "--host", "{host}", "--port", "{port}",
              "--max-batch-size", "64", "--threads", "1" if args.device == "cpu" else "4"]  # fmt: skip
    proc = EngineProcess(ServerConfig(model_path=str(model_dir), launch=launch,
                                      startup_timeout=120))  # fmt: skip
    proc.start()
    return proc


async def generate_many(url: str, prompts: list[list[int]], new: int, temperature: float):
    import asyncio

    from gyre.rollout.client import EngineClient
    from gyre.rollout.protocol import SamplingParams

    client = EngineClient(url)
    sp = SamplingParams(max_new_tokens=new, temperature=temperature, ignore_eos=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(client.generate(p, sp, f"r{i}") for i, p in enumerate(prompts))
    )
    return results, time.perf_counter() - t0


def trainer_logprobs(model: Any, prompt: list[int], result: Any, device: str) -> dict[str, float]:
    import torch

    from gyre.train.objective import target_logprobs

    ids = torch.tensor([prompt + result.output_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    n = len(result.output_ids)
    ours = target_logprobs(logits, ids)[0, -n:].double().cpu()
    exact = torch.log_softmax(logits[0, -n - 1 : -1].double(), -1)
    exact = exact.gather(-1, ids[0, -n:, None]).squeeze(-1).cpu()
    engine = torch.tensor(result.output_logprobs, dtype=torch.float64)
    return {"trainer_fn": float((ours - engine).abs().max()),
            "fp64_softmax": float((exact - engine).abs().max())}  # fmt: skip


def section_engine(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    import torch

    cuda = args.device.startswith("cuda")
    out: dict[str, Any] = {"dtypes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = engine_model_dir(args, Path(tmp))
        g = torch.Generator().manual_seed(0)
        calls, plen, new = (32, 128, 128) if cuda else (4, 16, 8)
        prompts = [torch.randint(3, 4096, (plen,), generator=g).tolist() for _ in range(calls)]
        for dtype in ("bfloat16", "float32") if cuda else ("float32",):
            proc = start_engine(args, model_dir, dtype)
            try:
                results, wall = asyncio.run(generate_many(proc.url, prompts, new, 1.0))
            finally:
                proc.stop()
            from gyre.models import load_model

            model, _ = load_model(str(model_dir))
            model.to(device=args.device, dtype=getattr(torch, dtype))
            diffs = [trainer_logprobs(model, p, r, args.device)
                     for p, r in zip(prompts[:8], results[:8])]  # fmt: skip
            tokens = sum(len(r.output_ids) for r in results)
            out["dtypes"][dtype] = {
                "startup_s": proc.startup_seconds, "calls": calls, "prompt_tokens": plen,
                "output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
                "logprob_max_abs_diff": max(d["trainer_fn"] for d in diffs),
                "logprob_max_abs_diff_fp64_softmax": max(d["fp64_softmax"] for d in diffs),
            }  # fmt: skip
            del model
            if cuda:
                torch.cuda.empty_cache()
    out["status"] = "ok"
    return out


# ----- (d) role switch --------------------------------------------------------------------
def used(device: str) -> int:
    from gyre.gpu.memory import memory_stats

    m = memory_stats(device)
    return m["total"] - m["free"]


def generate_status(url: str) -> int:
    """The HTTP status of a one-token /generate (503: the engine refuses, memory released)."""
    import json

    from gyre.rollout.client import blocking

    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
    status, _ = blocking(
        url, lambda c: c.transport.request("POST", "/generate", body.encode()), timeout=60
    )
    return status


def buffer_bytes(cell: Any, device: str) -> int:
    """Bytes of a training cell's flat weight and gradient buffers (its parameters are views)
    that are on `device`'s kind of device (on CPU the host: nothing leaves it)."""
    kind = torch_device_type(device)
    return sum(t.numel() * t.element_size() for t in (cell.flat_params, cell.flat_grads)
               if t.device.type == kind)  # fmt: skip


def torch_device_type(device: str) -> str:
    import torch

    return torch.device(device).type


def section_role_switch(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    import torch

    from gyre.gpu.memory import measure
    from gyre.models import load_model
    from gyre.rollout.client import EngineClient, blocking
    from gyre.rollout.protocol import release_procedure, resume_procedure
    from gyre.runtime.cell.residency import TrainerResidency
    from gyre.train.cell import TorchCell
    from gyre.train.config import ObjectiveConfig
    from gyre.train.objective import ExecutionScalar

    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    points: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = engine_model_dir(args, Path(tmp))
        proc = start_engine(args, model_dir, dtype)
        try:
            eng = EngineClient(proc.url, engine_id="cell0")
            prompt = [[5, 6, 7, 8, 9]]
            first, _ = asyncio.run(generate_many(proc.url, prompt, 16, 0.0))
            points["rollout_serving"] = used(args.device)
            t0 = time.perf_counter()
            asyncio.run(eng.run(release_procedure()))
            points["engine_release_s"] = time.perf_counter() - t0
            points["after_engine_release"] = used(args.device)
            points["engine_released"] = blocking(
                proc.url, lambda c: c.request("GET", "/health", None)
            )["released"]
            points["generate_status_while_released"] = generate_status(proc.url)
            t0 = time.perf_counter()
            model, _ = load_model(str(model_dir))
            model.to(device=args.device, dtype=getattr(torch, dtype))
            cell = TorchCell(model, objective=ObjectiveConfig())
            points["trainer_load_s"] = time.perf_counter() - t0
            steps, _ = batch(4096, executions=4, length=(64, 256), budget=2048)
            sc = {r.execution_id: ExecutionScalar(advantage=1.0, num_targets=r.num_targets,
                                                  log_ratio=0.0, gate=1.0)
                  for s in steps for r in s.rows}  # fmt: skip
            cell.accumulate(steps[0], sc)
            sync(args.device)
            points["training_step_done"] = used(args.device)
            trained = cell.flat_params.detach().to("cpu", copy=True)
            held = buffer_bytes(cell, args.device)
            off = TrainerResidency(device=args.device)  # what a colocated cell rank runs
            rep = measure(lambda: off.release(cell), args.device)
            points["trainer_release_s"] = rep.seconds
            points["trainer_bytes_released"] = held - buffer_bytes(cell, args.device)
            points["trainer_bytes_held_after_release"] = buffer_bytes(cell, args.device)
            points["after_trainer_release"] = used(args.device)
            t0 = time.perf_counter()
            asyncio.run(eng.run(resume_procedure()))
            again, _ = asyncio.run(generate_many(proc.url, prompt, 16, 0.0))
            points["engine_resume_s"] = time.perf_counter() - t0
            points["rollout_serving_again"] = used(args.device)
            points["same_output_after_switch"] = again[0].output_ids == first[0].output_ids
            t0 = time.perf_counter()
            off.restore(cell)  # the next switch to training: the parked weights come back
            sync(args.device)
            points["trainer_resume_s"] = time.perf_counter() - t0
            points["trainer_bytes_restored"] = buffer_bytes(cell, args.device)
            points["trainer_weights_restored_exactly"] = bool(
                torch.equal(cell.flat_params.detach().cpu(), trained)
            )
        finally:
            proc.stop()
    points["memory_unit"] = "bytes used on the device (total - free), whole GPU"
    points["status"] = "ok"
    return points


# ----- (e) Megatron TP = 2 ----------------------------------------------------------------
def section_megatron_tp2(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    cuda = args.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < 2:
        return {"status": "skipped",
                "reason": f"needs 2 GPUs (NCCL, one per TP rank); {torch.cuda.device_count()} "
                          "visible"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(tp2_rank, args=(args.device, args.size, tmp), nprocs=2, join=True)
        out: dict[str, Any] = json.loads((Path(tmp) / "result.json").read_text())
    out["status"] = "ok"
    return out


def tp2_rank(rank: int, device: str, size: str, tmp: str) -> None:
    """One TP rank of `section_megatron_tp2` (rank 0 also runs the torch reference); the two
    meet at a file store in `tmp` (no port to pick and lose to another process)."""
    import torch
    import torch.distributed as dist

    from gyre.train.config import ObjectiveConfig, OptimConfig
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import (
        MegatronCell,
        ModelParallelOptimizer,
        build_gpt_model,
        init_model_parallel,
    )
    from gyre.train.megatron.weights import WeightLayout, hf_to_mcore

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store",
                            rank=rank, world_size=2)  # fmt: skip
    try:
        cfg = MegatronConfig(tensor_parallel=2, dtype="float32")
        init_model_parallel(cfg, f"cuda:{rank}" if cuda else "cpu")
        config = qwen_config(size)
        hfc, layout = config.to_dict(), WeightLayout.from_hf_config(config.to_dict())
        ref = hf_model(config, "cpu", torch.float32)  # the same seed on both ranks
        meg = build_gpt_model(hfc, cfg, device=f"cuda:{rank}" if cuda else "cpu")
        shard = hf_to_mcore(ref.state_dict(), layout, tp_rank=rank, tp_size=2)
        load = meg.load_state_dict(shard, strict=False)
        assert not load.unexpected_keys, load.unexpected_keys
        steps, info = batch(config.vocab_size, executions=6, length=(64, 384), budget=2048)
        cell = MegatronCell(meg, objective=ObjectiveConfig())
        got = run_batch(cell, steps, info)
        norm = ModelParallelOptimizer(cell, OptimConfig()).global_norm(cell.flat_grads)
        got["grad_norm"] = norm / info.num_executions
        grads = {k: p.grad.detach().cpu() for k, p in meg.named_parameters() if p.grad is not None}
        torch.save(grads, Path(tmp) / f"grads{rank}.pt")
        dist.barrier()
        if rank == 0:
            result = tp2_compare(ref.to(device=f"cuda:{rank}" if cuda else "cpu"), got,
                                 steps, info, layout, Path(tmp))  # fmt: skip
            (Path(tmp) / "result.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def tp2_compare(ref: Any, got: dict[str, Any], steps: list, info: Any, layout: Any,
                tmp: Path) -> dict[str, Any]:  # fmt: skip
    """The torch backend's step on the whole model against the TP = 2 cell's."""
    import torch

    from gyre.train.cell import TorchCell
    from gyre.train.config import ObjectiveConfig
    from gyre.train.megatron.weights import mcore_to_hf

    want = run_batch(TorchCell(ref, objective=ObjectiveConfig()), steps, info)
    shards = [torch.load(tmp / f"grads{r}.pt") for r in range(2)]
    gathered = mcore_to_hf(shards, layout)
    worst = max(
        float((gathered[k].double() - p.grad.double().cpu()).norm()
              / p.grad.double().norm().clamp_min(1e-30))
        for k, p in ref.named_parameters() if k in gathered
    )  # fmt: skip
    tol = TOLERANCES["float32"]
    return {
        "tensor_parallel": 2, "dtype": "float32", "micro_steps": len(steps),
        "torch": want, "megatron_tp2": got,
        "objective_rel_diff": rel(got["objective"], want["objective"]),
        "grad_norm_rel_diff": rel(got["grad_norm"], want["grad_norm"]),
        "worst_tensor_grad_rel_l2": worst, "tensors_compared": len(gathered), "tolerance": tol,
        "pass": rel(got["objective"], want["objective"]) <= tol["objective_rel"]
        and rel(got["grad_norm"], want["grad_norm"]) <= tol["grad_norm_rel"],
    }  # fmt: skip


# ----- run: `gyre run` on the GPU --------------------------------------------------------
def image_modules() -> set[str]:
    """Top-level modules of the device image's packages (IMAGE and what they require, read
    from this machine's metadata) and of the carried wheels."""
    import importlib.metadata as md
    import re

    wanted, seen = [*IMAGE, *CARRIED.values(), *CARRIED_DEPENDENCIES], set()
    while wanted:
        name = wanted.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        wanted += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in requires
                   if "extra ==" not in r]  # fmt: skip
    modules = {"gyre"}
    for module, dists in md.packages_distributions().items():
        if any(d.lower().replace("_", "-") in seen for d in dists):
            modules.add(module)
    return modules


def section_run(args: argparse.Namespace) -> dict[str, Any]:
    """`gyre run` of templates/local.yaml for 2 steps on this machine's device: one cell of
    one rank, the Megatron backend in bf16 (`train.device`), its embedded engine beside it
    (`engine.device`, colocated: the trainer parks on every switch to rollout). Passes when
    the run completes both steps, and on CUDA every switch to rollout left the trainer's
    GPU memory lower than it found it (the switch events' `device_allocated_before/after`).
    On CPU (the rehearsal) every process runs under tools/gpu_image_guard: a package the
    device image lacks and the wheels do not carry fails it."""
    from gyre.trajectory.store import TraceReader

    on_gpu = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, blocked = Path(tmp) / "run", Path(tmp) / "blocked.txt"
        env = dict(os.environ)
        if not on_gpu:
            guard = str(ROOT / "tools" / "gpu_image_guard")
            env.update(PYTHONPATH=os.pathsep.join(filter(None, [guard, str(ROOT),
                                                                env.get("PYTHONPATH")])),
                       GYRE_IMAGE_ALLOWED=",".join(sorted(image_modules())),
                       GYRE_IMAGE_CHECKED=",".join(["gyre", *(m.split(".")[0] for m in CARRIED)]),
                       GYRE_IMAGE_BLOCKED=str(blocked))  # fmt: skip
        cmd = [sys.executable, "-m", "gyre", "run", str(ROOT / "templates" / "local.yaml"),
               "topology.cells=1", "topology.ranks_per_cell=1", "train.backend=megatron",
               "train.dtype=bfloat16", f"train.device={args.device}",
               f"engine.device={'cuda' if on_gpu else 'cpu'}", "--steps", "2",
               "--run-dir", str(run_dir), "--quiet"]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp,
                              timeout=BUDGET_S["run"] * 3 - 10)  # fmt: skip
        wall = time.perf_counter() - t0
        out: dict[str, Any] = {"status": "ok", "command": " ".join(cmd[1:]), "wall_s": wall,
                               "exit": proc.returncode}  # fmt: skip
        # imports the image could not serve: Gyre's fail the check, a carried package's
        # (its optional extras, e.g. aiohttp's brotli) are listed
        out["blocked_imports"] = sorted(set(blocked.read_text().split("\n")) - {""}
                                        if blocked.exists() else [])  # fmt: skip
        gyre_blocked = [b for b in out["blocked_imports"] if b.endswith("(imported by gyre)")
                        and b.split()[0] not in OPTIONAL]  # fmt: skip
        if proc.returncode != 0:
            out.update(status="error", stderr_tail=(proc.stdout + proc.stderr)[-3000:])
            return out
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        with TraceReader(run_dir / "trace.h5") as r:
            events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
    parks = [d for k, d in events if k == "switch" and d["to"] == "rollout"]
    out.update({k: summary.get(k) for k in ("steps_done", "train_backend", "train_dtype",
                                            "switches", "publications", "switch_s_mean")})  # fmt: skip
    out["parks"] = [{k: d.get(k) for k in ("trainer_parked_bytes", "device_allocated_before",
                                           "device_allocated_after")} for d in parks]  # fmt: skip
    out["memory_falls_on_every_park"] = (
        all(d["device_allocated_after"] < d["device_allocated_before"] for d in parks)
        if on_gpu and parks and all("device_allocated_after" in d for d in parks)
        else None
    )  # None: not measurable here (a CPU trainer does not park)
    out["pass"] = (summary.get("steps_done") == 2 and summary.get("train_dtype") == "bfloat16"
                   and not gyre_blocked and bool(parks)
                   and (out["memory_falls_on_every_park"] is True or not on_gpu))  # fmt: skip
    return out


# ----- orchestration ----------------------------------------------------------------------
FUNCS = {"run": section_run, "parity": section_parity, "train_speed": section_train_speed,
         "engine": section_engine, "role_switch": section_role_switch,
         "megatron_tp2": section_megatron_tp2}  # fmt: skip


def imports() -> dict[str, str]:
    """Version of each carried package, or why it does not import."""
    import importlib
    import importlib.metadata

    found = {}
    for name, dist in CARRIED.items():
        try:
            importlib.import_module(name)
            found[name] = importlib.metadata.version(dist)
        except Exception as e:  # ImportError, or a package broken on this machine
            found[name] = f"{type(e).__name__}: {e}"
    return found


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": args.device, "size": args.size,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tolerances": TOLERANCES,
    }  # fmt: skip
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    info["imports"] = imports()
    info["megatron_core"] = info["imports"]["megatron.core"]
    return info


def run_section(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one section in a subprocess under its time budget."""
    budget = BUDGET_S[name] * (3 if args.device == "cpu" else 1)
    with tempfile.NamedTemporaryFile(suffix=".json") as part:
        cmd = [sys.executable, __file__, "--section", name, "--part", part.name,
               "--device", args.device, "--size", args.size]  # fmt: skip
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            return {"status": "timeout", "budget_s": budget,
                    "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}  # fmt: skip
        took = time.perf_counter() - t0
        text = Path(part.name).read_text()
        if proc.returncode != 0 or not text:
            return {"status": "error", "exit": proc.returncode, "seconds": took,
                    "stderr_tail": proc.stderr[-3000:]}  # fmt: skip
        result = json.loads(text)
        result["seconds"] = took
        return result


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gyre_gpu.json"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.section:  # child: one section, result to --part
        try:
            result = FUNCS[args.section](args)
        except Exception as e:
            result = {"status": "error", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        Path(args.part).write_text(json.dumps(result, default=str))
        return 0
    report: dict[str, Any] = {"meta": meta(args), "sections": {}}
    for name in args.sections.split(","):
        print(f"[gpu_check] {name} ...", flush=True)
        report["sections"][name] = run_section(name, args)
        print(f"[gpu_check] {name}: {report['sections'][name].get('status')}", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
