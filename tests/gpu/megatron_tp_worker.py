"""One rank of a tensor-parallel Megatron world on CPU (gloo), for test_gpu_megatron_cpu.py.

    python megatron_tp_worker.py RANK WORLD PORT OUT_DIR

Builds Gyre's GPTModel of the tiny Qwen2 (`build_gpt_model` + `hf_to_mcore`, this rank's TP
shard), runs the micro-step's rows forward through `MegatronCell` (vocab-parallel
cross-entropy), backward of the summed target log-probs, and writes this rank's log-probs
and its shard's gradients (Megatron names) to OUT_DIR/rank<R>.pt.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    from gyre.models import load_model
    from gyre.train.megatron import cpu
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_gpt_model, init_model_parallel
    from gyre.train.megatron.weights import Layout, hf_to_mcore
    from gyre.train.objective import ObjectiveConfig

    init_model_parallel(MegatronConfig(tensor_parallel=world, dtype="float32"))
    hf, _ = load_model("tiny")
    hfc = hf.config.to_dict()
    model = build_gpt_model(hfc, MegatronConfig(tensor_parallel=world, dtype="float32"),
                            device="cpu")  # fmt: skip
    shard = hf_to_mcore(dict(hf.state_dict()), Layout.from_hf_config(hfc), tp_rank=rank,
                        tp_size=world)  # fmt: skip
    model.load_state_dict(shard, strict=False)
    cell = MegatronCell(model.train(), objective=ObjectiveConfig())
    step = torch.load(f"{out}/step.pt", weights_only=False)
    logp, st = cell._logprobs(step, grad=True)
    (logp * st.targets).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.save({"logp": logp.detach(), "grads": grads, "patched": cpu.active()},
               f"{out}/rank{rank}.pt")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
