"""One rank of a Megatron cell built by the runtime's own `MEGATRON.build`, for
test_gpu_megatron_shard_load.py.

    mpiexec -n 2 python megatron_build_worker.py MODEL_DIR OUT_DIR

For each layout (TP 2, then PP 2) and each model (MODEL_DIR, the tiny model saved as
safetensors: every rank reads its slice of the files; then ``tiny``, built in the leader's
memory: the leader scatters the shards) this rank builds its shard of a core cell and
writes OUT_DIR/tp<T>pp<P>-<dir|tiny>-rank<R>.pt: its Megatron tensors, whether
transformers' Qwen2 model code was imported in this process by then, and (the leader) the
one-process gather of every shard (`MegatronReplica._gather`: the shards put back together).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch


def main(model_dir: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from mpi4py import MPI

    from gyre.train.backends.megatron import MEGATRON
    from gyre.train.comm import arrive, build_communicators
    from gyre.train.config import ParallelDims, TrainConfig
    from gyre.train.megatron.weights import tensor_state

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    comms = build_communicators(world, cell_of_rank=[0] * world.Get_size())
    for tp, pp in ((2, 1), (1, 2)):
        for name, model in (("dir", model_dir), ("tiny", "tiny")):
            dims = ParallelDims(tensor=tp, pipeline=pp, data=1)
            replica = MEGATRON.build(model, TrainConfig(backend="megatron"), dims, core=True,
                                     device="cpu", comms=comms, host="127.0.0.1")  # fmt: skip
            record = {
                "tensors": {k: v.clone() for k, v in tensor_state(replica.cell.model).items()},
                "qwen2_code": "transformers.models.qwen2.modeling_qwen2" in sys.modules,
            }
            gathered = replica._gather(replica._views(replica.cell.flat_params))
            if gathered is not None:
                record["gathered"] = {k: v.clone() for k, v in gathered.items()}
            torch.save(record, Path(out) / f"tp{tp}pp{pp}-{name}-rank{rank}.pt")
            arrive(world)
        parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    from mpi4py import MPI

    try:
        main(sys.argv[1], sys.argv[2])
    except BaseException:  # abort the whole world instead of hanging it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()  # the world's abort may cut mpiexec's forwarding: keep it on disk too
        error = Path(sys.argv[-1]) / f"rank{MPI.COMM_WORLD.Get_rank()}.error"
        error.write_text(traceback.format_exc())
        MPI.COMM_WORLD.Abort(1)
