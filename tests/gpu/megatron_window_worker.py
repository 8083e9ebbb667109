"""One rank of a TP x PP Megatron world on CPU (gloo) running a window of micro-steps both
ways, for test_gpu_megatron_window.py.

    python megatron_window_worker.py RANK WORLD INIT OUT_DIR PIPELINE MICROSTEPS [ORDER]

Builds the tiny Qwen2's `MegatronCell` (this rank's TP shard of its stage), then runs the
same MICROSTEPS micro-steps (rows of different widths, an execution spread over two of
them) twice from zero gradients: one at a time (`prepass` / `accumulate`, each micro-step
alone through the stages) and as one window (`prepass_window` / `accumulate_window`, 1F1B
through the stages; ORDER "reversed" hands the window its micro-steps in reverse, a check
that the comparison sees the order). Writes both runs' ratio sums, stats and accumulated
gradients, and the window's stage timing, to OUT_DIR/rank<R>.pt.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist


def window(count: int) -> list:
    """`count` micro-steps of 2-3 rows of different widths; execution e0 has rows in the
    first and the last."""
    from gyre.train.packing import MicroStep, TokenRow

    gen = np.random.default_rng(1)
    steps = []
    for i in range(count):
        rows = []
        for k, n in enumerate((11 + 3 * i, 6 + i, 8)[: 2 + i % 2]):
            eid = "e0" if (k == 0 and i in (0, count - 1)) else f"e{i}-{k}"
            targets = np.arange(n) >= n // 2
            rows.append(TokenRow(
                execution_id=eid, group_id="g0", policy_version=0,
                ids=gen.integers(0, 4096, n).astype(np.int64), targets=targets,
                behaviour_logprobs=np.where(targets, -1.0 - 0.1 * k, 0.0), advantage=1.0 - k,
                execution_targets=int(targets.sum()), weights=targets / targets.sum(),
            ))  # fmt: skip
        steps.append(MicroStep(index=i, rows=tuple(rows)))
    return steps


def main(rank: int, world: int, init: str, out: str, pipeline: int, count: int,
         order: str = "same") -> None:  # fmt: skip
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=world)  # fmt: skip
    from gyre.models import load_model
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, build_rank_model
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore
    from gyre.train.objective import ObjectiveConfig
    from gyre.train.scalars import ExecutionScalar

    tp = world // pipeline
    hf, _ = load_model("tiny")
    hfc = hf.config.to_dict()
    shard = stage_to_mcore(dict(hf.state_dict()), WeightLayout.from_hf_config(hfc),
                           tp_rank=rank % tp, tp_size=tp, stage=rank // tp, stages=pipeline)  # fmt: skip
    mcfg = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pipeline)
    cell = MegatronCell(build_rank_model(hfc, shard, mcfg, device="cpu"),
                        objective=ObjectiveConfig())  # fmt: skip
    steps = window(count)
    executions = {r.execution_id: r for s in steps for r in s.rows}
    scalars = {e: ExecutionScalar(advantage=r.advantage, num_targets=int(r.targets.sum()),
                                  log_ratio=0.05, gate=1.0)
               for e, r in executions.items()}  # fmt: skip
    alone = {"sums": [cell.prepass(s) for s in steps],
             "stats": [cell.accumulate(s, scalars) for s in steps],
             "grads": cell.flat_grads.clone()}  # fmt: skip
    cell.zero_grad()
    given = steps[::-1] if order == "reversed" else steps
    sums = cell.prepass_window(given)
    stats = cell.accumulate_window(given, scalars)
    windowed = {"sums": sums, "stats": stats, "grads": cell.flat_grads.clone(),
                "timing": cell.timing}  # fmt: skip
    torch.save({"alone": alone, "window": windowed}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2], a[3], int(a[4]), int(a[5]), *a[6:7])
