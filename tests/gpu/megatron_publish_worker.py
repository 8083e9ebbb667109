"""One rank of a Megatron core cell publishing to a real embedded engine, for
test_gpu_megatron_publish.py.

    mpiexec -n 4 python megatron_publish_worker.py WATCHED_URL ENGINE_URL OUT_DIR

For each layout (TP 2 x PP 2, then TP 1 x PP 2 x data 2) this rank builds its shard of the
tiny model with the runtime's `MEGATRON.build`, moves its weights off the initial ones
(noise seeded by the cell rank, so data replica 1 differs from replica 0: a part sent from
it would show), and takes part in two publications (`publish_parts`, the cell's own call) to
the engine behind WATCHED_URL (a recording forwarder): through update groups (the senders
at 127.0.0.2, so the engine is on "another node") and by handle (the senders at the
engine's own address). After each, the leader asks the engine for a greedy completion with
log-probs (a third time the leader's engine is reloaded from the cell: `reload_parts`, as
the core's engine back in rollout), then loads the one-process gather (`MegatronReplica._gather`: every shard of
every stage to the leader, `stages_to_hf`) into the engine directly, by value, and asks
again. Then the cell writes a policy directory (`save_parts`: each stage's sender its own
file) under OUT_DIR/<layout>/. Each rank writes OUT_DIR/<layout>-rank<R>.pt: the names it
sent per publication, and (the leader) the missed engines, both completions, the policy's
path and the one-process gather of the weights it holds.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

PROMPT = [3, 17, 42, 7, 99, 12, 5]


def _completion(url: str, rid: str) -> tuple[list[int], list[float], str | None]:
    from gyre.rollout.client import EngineClient
    from gyre.rollout.protocol import SamplingParams

    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> Any:
        client = EngineClient(url)
        try:
            return await client.generate(PROMPT, greedy, rid)
        finally:
            client.close()

    got = asyncio.run(run())
    return list(got.output_ids), list(got.output_logprobs), got.weight_version


def main(watched: str, engine_url: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from mpi4py import MPI

    from gyre.runtime.cell.engine_host import push_weights
    from gyre.runtime.cell.publication import publish_parts, reload_parts
    from gyre.runtime.shared.config import EngineConfig
    from gyre.runtime.shared.policies import save_parts
    from gyre.train.backends.megatron import MEGATRON
    from gyre.train.comm import arrive, build_communicators
    from gyre.train.config import ParallelDims, TrainConfig

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    comms = build_communicators(world, cell_of_rank=[0] * world.Get_size())
    version = 0
    for tp, pp, data in ((2, 2, 1), (1, 2, 2)):
        dims = ParallelDims(tensor=tp, pipeline=pp, data=data)
        replica = MEGATRON.build("tiny", TrainConfig(backend="megatron"), dims, core=True,
                                 device="cpu", comms=comms, host="127.0.0.1")  # fmt: skip
        record: dict[str, Any] = {"sent": {}, "missed": {}, "published": {}, "reference": {}}
        for how, host, config in (
            ("group", "127.0.0.2", EngineConfig(publication="distributed")),
            ("handle", "127.0.0.1", EngineConfig()),
            ("reload", "127.0.0.1", EngineConfig()),
        ):
            version += 1
            gen = torch.Generator().manual_seed(1000 * version + rank)
            flat = replica.cell.flat_params
            flat.add_(0.05 * torch.randn(flat.shape, generator=gen).to(flat.dtype))
            part = replica.part(comms.shard)
            record["sent"][how] = None if part is None else [n for n, _ in part]
            if how == "reload":  # the leader's own engine behind the cell: `reload_parts`
                missed = reload_parts(comms.cell, functools.partial(replica.part, comms.shard),
                                      [(0, watched)] if rank == 0 else [], version, config,
                                      host)  # fmt: skip
            else:
                missed = publish_parts(comms.cell, part, [(0, watched)], version, config, host)
            reference = replica._gather(replica._views(flat))  # the one-process gather
            if rank == 0:
                assert reference is not None
                record["missed"][how] = missed
                record["published"][how] = _completion(engine_url, f"pub-{version}")
                push_weights(engine_url, sorted(reference.items()), 100 + version, tp_size=1)
                record["reference"][how] = _completion(engine_url, f"ref-{version}")
            arrive(world)
        # the policy directory, each stage's file written by its sender (`save_parts`)
        config, generation = replica.policy_configs()
        name = f"tp{tp}pp{pp}d{data}"
        saved = save_parts(comms.cell, replica.part(comms.shard), Path(out) / name, "v00001",
                           version=version, config=config, tokenizer=replica.tokenizer,
                           generation=generation)  # fmt: skip
        gathered = replica._gather(replica._views(replica.cell.flat_params))
        if rank == 0:
            record["policy"], record["gathered"] = str(saved), gathered
        torch.save(record, Path(out) / f"tp{tp}pp{pp}d{data}-rank{rank}.pt")
        arrive(world)
        parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    from mpi4py import MPI

    try:
        main(sys.argv[1], sys.argv[2], sys.argv[3])
    except BaseException:  # abort the whole world instead of hanging it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()  # the world's abort may cut mpiexec's forwarding: keep it on disk too
        error = Path(sys.argv[-1]) / f"rank{MPI.COMM_WORLD.Get_rank()}.error"
        error.write_text(traceback.format_exc())
        MPI.COMM_WORLD.Abort(1)
