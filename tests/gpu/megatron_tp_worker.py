"""One rank of a tensor- and pipeline-parallel Megatron world on CPU (gloo), for
test_gpu_megatron_cpu.py.

    python megatron_tp_worker.py RANK WORLD INIT OUT_DIR [PIPELINE [DTYPE [ATTENTION [SEQUENCE]]]]

Builds Gyre's GPTModel of the tiny Qwen2 (`stage_to_mcore` + `build_rank_model`: this rank's
TP shard of its pipeline stage; TP = WORLD / PIPELINE) in DTYPE (float32, or bfloat16 with the
cell's mixed precision) with core attention ATTENTION ("sdpa", the default, or "local"), runs
the micro-step's rows forward through `MegatronCell` (stage by stage; vocab-parallel chunked
log-probs), the cell's backward of the summed target log-probs, and writes this rank's
log-probs and its shard's accumulated gradients (Megatron names) to OUT_DIR/rank<R>.pt.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist


def main(
    rank: int,
    world: int,
    init: str,
    out: str,
    pipeline: int = 1,
    dtype: str = "float32",
    attention: str = "sdpa",
    sequence: str = "auto",
) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=world)  # fmt: skip
    from gyre.models import load_model
    from gyre.train.megatron import cpu
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore
    from gyre.train.objective import ObjectiveConfig

    tp = world // pipeline
    mcfg = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pipeline, dtype=dtype,  # type: ignore[arg-type]
                          attention=attention,  # type: ignore[arg-type]
                          sequence_parallel={"auto": None, "on": True, "off": False}[sequence])  # fmt: skip
    hf, _ = load_model("tiny")
    hfc = hf.config.to_dict()
    shard = stage_to_mcore(dict(hf.state_dict()), WeightLayout.from_hf_config(hfc), tp_rank=rank % tp,
                           tp_size=tp, stage=rank // tp, stages=pipeline)  # fmt: skip
    model = build_rank_model(hfc, shard, mcfg, device="cpu")  # the backend's own build
    cell = MegatronCell(model, objective=ObjectiveConfig())
    step = torch.load(f"{out}/step.pt", weights_only=False)
    logp, st = cell._logprobs(step, grad=True)
    cell._backward((logp * st.targets).sum())  # the last stage's loss; the others' gradients
    grads = {n: cell.grad_of(p).detach().clone() for n, p in model.named_parameters()}
    torch.save({"logp": logp.detach(), "grads": grads, "patched": cpu.active(),
                "sequence_parallel": model.config.sequence_parallel}, f"{out}/rank{rank}.pt")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    pipeline = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    dtype = sys.argv[6] if len(sys.argv) > 6 else "float32"
    attention = sys.argv[7] if len(sys.argv) > 7 else "sdpa"
    sequence = sys.argv[8] if len(sys.argv) > 8 else "auto"
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        pipeline,
        dtype,
        attention,
        sequence,
    )
