"""The Megatron training backend: the model sharded over a cell's ranks (`train.backend`).

megatron-core's GPTModel sharded over the cell's ranks with tensor and pipeline parallelism,
`data` replicas of it side by side (torch.distributed over the cell ranks: gloo on CPU, NCCL
on GPU; each rank's shard built on its own device, `gyre.train.megatron.model.build_rank_model`;
rank s of a cell is TP rank s % TP of stage s // TP % PP in replica s // (TP x PP):
`ParallelDims.place`). Every rank of a replica runs the replica's share of a micro-step's
rows (the stages one after the other); each core rank of replica 0 steps AdamW on its own
shard with the whole model's gradient norm, the other replicas receive its weights
(`gyre.runtime.cell.trainer`). No rank holds the whole model: what the engines load and
policies save leaves from the ranks that hold each stage (`MegatronReplica.part`), and the
Hugging Face names and order come from a meta-device skeleton of the model's config
(`gyre.train.megatron.weights.hf_order`). Checkpoints are written by every core rank of replica 0 in parallel,
its own shard's main weights and AdamW moments (`gyre.train.core_file.save_shard`; the other
replicas hold the same weights and no optimizer); a resume at other TP / PP sizes (or by the
torch backend) reads them put together into the HF layout, one at other data sizes the same
shard files. docs/gpu.md.

    replica = MEGATRON.build(cfg.model, cfg.train, dims, core=True, device="cuda:0",
                             comms=comms, host="10.0.0.5")
    replica.part(shard)        # a stage's sender: its stage's HF-layout weights

Torch and megatron-core are imported when a replica is built, not with this module.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.errors import ConfigError, TrainingError
from gyre.train import core_file
from gyre.train.backends.protocol import TrainBackend
from gyre.train.backends.torch import TorchReplica
from gyre.train.config import ParallelConfig, ParallelDims

if TYPE_CHECKING:
    import torch

    from gyre.train.comm import Communicators
    from gyre.train.config import TrainConfig
    from gyre.train.megatron.weights import Source


MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's elementwise state: laid out like the weights, sharded with them."""


@dataclass(slots=True)
class MegatronReplica(TorchReplica):
    """This rank's tensor-parallel shard of its pipeline stage of the model."""

    comm: Any  # MPI: its data-parallel replica's ranks in the cell (shard gathers to the leader)
    stage_comm: Any  # MPI: its stage's TP ranks in its replica (a part's gather on the host)
    data_rank: int  # its data-parallel replica in the cell: 0 gathers, steps and saves
    layout: Any  # gyre.train.megatron.weights.WeightLayout of the model
    hf_config: dict[str, Any]  # the Hugging Face model's config (`PretrainedConfig.to_dict`)
    generation: Any  # the leader's: the model's generation config (else None)

    def policy_configs(self) -> tuple[Any, Any]:
        from gyre.train.megatron.weights import hf_model_config

        return hf_model_config(self.hf_config), self.generation

    def hf_shapes(self) -> list[tuple[str, torch.Size]]:
        """The HF model's trainable parameters' names and shapes in its flat order (a
        meta-device skeleton's: `gyre.train.megatron.weights.hf_shapes`)."""
        from gyre.train.megatron.weights import hf_shapes

        return hf_shapes(self.hf_config)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        raise TrainingError("megatron replica: no rank holds the whole model; each stage's "
                            "sender holds its part (Replica.part)")  # fmt: skip

    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Every rank's shard tensors → the HF-layout tensors on the leader. Each is copied
        out of its flat buffer first: a pickled view carries its whole storage (on CPU, where
        `.cpu()` is the view itself, a cell's ~300 views pickled ~300 flat buffers). Named as
        the HF model's modules name them (an MoE layer's experts stacked: `module_names`)."""
        from gyre.train.megatron.weights import module_names, stages_to_hf

        if self.data_rank != 0:  # replica 0 holds the same weights
            return None
        shards = self.comm.gather({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
                                  root=0)  # fmt: skip
        if shards is None:
            return None
        return module_names(stages_to_hf(shards, self.layout, tp_size=self.dims.tensor),
                            self.layout)  # fmt: skip

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flat buffer's slice of every trainable parameter, by Megatron name."""
        return core_file.views(flat, self._names())

    def part(self, shard: int) -> list[tuple[str, torch.Tensor]] | None:
        """A publication's part (collective over the cell), sent from the ranks that hold
        the weights: on each stage's sender — TP rank 0 of data replica 0 — that stage's
        HF-layout tensors (`stage_to_hf`, the conversion a whole-cell gather uses), its TP
        ranks' shards gathered inside the stage: on a GPU by Megatron's tensor-parallel
        group (NCCL: they stay on the device), on the host (a CPU cell, or a trainer parked
        off its GPU for the engine) tensor by tensor over MPI (`stage_comm`); None on every
        other rank. No rank holds another stage's tensors, the leader included."""
        from megatron.core import parallel_state as ps

        from gyre.train.megatron.weights import module_names, stage_to_hf

        if self.data_rank != 0:  # replica 0 holds the same weights
            return None
        shards = self._stage_shards(self.cell.flat_params.detach())
        if shards is None:
            return None
        hf = stage_to_hf(shards, self.layout, stage=ps.get_pipeline_model_parallel_rank(),
                         stages=self.dims.pipeline)  # fmt: skip
        return list(module_names(hf, self.layout).items())

    def _stage_shards(self, flat: torch.Tensor) -> list[dict[str, torch.Tensor]] | None:
        """Every TP rank's tensors of this stage (views of `flat`), on the stage's TP rank 0;
        None on the others."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        tp = self.dims.tensor
        if tp == 1:
            return [self._views(flat)]
        if not flat.is_cuda:  # copies: a pickled view carries its whole flat buffer
            mine = {k: v.to("cpu", copy=True) for k, v in self._views(flat).items()}
            return self.stage_comm.gather(mine, root=0)
        lead = ps.get_tensor_model_parallel_rank() == 0
        flats = [torch.empty_like(flat) for _ in range(tp)] if lead else None
        dist.gather(flat, flats, group=ps.get_tensor_model_parallel_group(), group_dst=0)
        return None if flats is None else [self._views(f) for f in flats]

    def hf_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        import torch

        hf = self._gather(self._views(flat))
        if hf is None:
            return None
        return torch.cat([hf[n].reshape(-1) for n, _ in self.hf_shapes()])

    def optimizer_state(self) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        state = self.optimizer.opt.state_dict()  # its per-parameter dicts are the live ones
        if 0 in state["state"]:
            moments = dict(state["state"][0])
            for key in MOMENTS:
                if key in moments:
                    moments[key] = self.hf_flat(moments[key])
            state["state"] = {**state["state"], 0: moments}
        return state

    def save(self, folder: Path, version: int, shard: int) -> int:
        """This rank's shard of the core's checkpoint, written by the rank itself (every
        core rank of replica 0 in parallel, nothing gathered; the other replicas write
        nothing): its main weights, AdamW moments and step
        (`gyre.train.core_file.save_shard`); bytes."""
        import dataclasses

        if self.data_rank != 0:
            return 0
        if self.optimizer is None:
            raise TrainingError("megatron replica: only a core rank writes a checkpoint shard")
        names = self._names()
        state = self.optimizer.opt.state_dict()
        flats = {
            "main": self.optimizer.main.detach(),
            **{k: v for k, v in state["state"].get(0, {}).items() if k in (*MOMENTS, "step")},
        }
        meta = {"version": version, "shard": shard, "tensor": self.dims.tensor,
                "pipeline": self.dims.pipeline, "names": names,
                "layout": dataclasses.asdict(self.layout),
                "param_groups": state["param_groups"]}  # fmt: skip
        if self.comm.Get_rank() == 0:  # the leader: the HF order an assembled state takes
            meta["hf_order"] = [n for n, _ in self.hf_shapes()]
        return core_file.save_shard(folder, shard, flats, meta)

    def restore(self, folder: Path) -> int:
        """Weights and AdamW moments from a checkpoint: at the cell's own tensor, pipeline
        and expert sizes this rank's shard file alone (its replica's, whatever the data
        size); else (other sizes, an HF-layout core
        file from either backend, either dtype) the HF layout split to this rank's shard of
        its stage.
        Collective over the cell."""
        first = core_file.shard_meta(folder)
        if first is not None and (first["tensor"], first["pipeline"], core_file.expert(first)) == (
            self.dims.tensor,
            self.dims.pipeline,
            self.dims.expert,
        ):
            return self._restore_own_shard(folder)
        if first is not None:
            return self._restore_other_shards(folder, first)
        data = core_file.load(folder)
        self._load_weights(dict(data["named"]))
        state = data["optimizer"]
        if self.optimizer is not None and state is not None:
            shapes = [(n, t.shape) for n, t in data["named"]]
            moments = state["state"].get(0, {})
            for key in MOMENTS:
                if key in moments:
                    moments[key] = self._shard_flat(moments[key], shapes)
            self.optimizer.opt.load_state_dict(state)
        return int(data["version"])

    def _restore_other_shards(self, folder: Path, first: dict[str, Any]) -> int:
        """A sharded checkpoint taken at other model-parallel sizes: each of its buffers
        (weights, then each moment) split to this rank's flat shard, read a layer at a time
        from the ranges of the files that hold it (`core_file.source`) and copied into the
        flat buffer a tensor at a time, so a rank holds one layer of the model beside the
        buffers it keeps, never a model-sized buffer or its shard twice."""
        from gyre.rollout.weights import load_named_tensors

        main = self._flat_of(core_file.source(folder, "main"))
        load_named_tensors(self.cell.model, sorted(core_file.views(main, self._names()).items()))
        if self.optimizer is not None:
            self.optimizer.load_main(main)
            del main
            if "exp_avg" in core_file.shard_keys(folder):
                moments = {k: self._flat_of(core_file.source(folder, k)).to(self.cell.device)
                           for k in MOMENTS}  # fmt: skip
                self.optimizer.opt.load_state_dict({
                    "state": {0: {"step": core_file.shard_step(folder), **moments}},
                    "param_groups": first["param_groups"]})  # fmt: skip
        return int(first["version"])

    def _names(self) -> list[list[Any]]:
        """Each trainable parameter's name and shape, in the order of the flat buffers."""
        return [[n, list(p.shape)] for n, p in self.cell.model.named_parameters()
                if p.requires_grad]  # fmt: skip

    def _flat_of(self, hf: Source) -> torch.Tensor:
        """This rank's float32 flat buffer of HF-layout tensors (the order of `_names`), each
        of its tensors cut from `hf` and copied in as it comes (`iter_stage_to_mcore`)."""
        import torch
        from megatron.core import parallel_state as ps

        from gyre.train.megatron.weights import iter_stage_to_mcore

        at = core_file.offsets(self._names())
        flat = torch.empty(max((b for _, b, _ in at.values()), default=0), dtype=torch.float32)
        for name, t in iter_stage_to_mcore(hf, self.layout,
                                           tp_rank=ps.get_tensor_model_parallel_rank(),
                                           tp_size=self.dims.tensor,
                                           stage=ps.get_pipeline_model_parallel_rank(),
                                           stages=self.dims.pipeline):  # fmt: skip
            if name not in at:
                raise TrainingError(f"checkpoint: {name!r} is no trainable parameter of this rank")
            a, b, _ = at.pop(name)
            flat[a:b].copy_(t.reshape(-1))
        if at:
            raise TrainingError(f"checkpoint: no tensor for {sorted(at)[:3]} of this rank")
        return flat

    def _restore_own_shard(self, folder: Path) -> int:
        """This rank's shard file of a checkpoint taken at the cell's own model-parallel
        sizes (its position in its replica: `comm`'s rank)."""
        from gyre.rollout.weights import load_named_tensors

        flats, meta = core_file.read_shard(folder, self.comm.Get_rank())
        mine = core_file.views(flats["main"], meta["names"])
        load_named_tensors(self.cell.model, sorted(mine.items()))
        if self.optimizer is not None:
            self.optimizer.load_main(flats["main"])
            moments = {k: flats[k].to(self.cell.device) for k in MOMENTS if k in flats}
            if moments:
                self.optimizer.opt.load_state_dict({
                    "state": {0: {"step": flats["step"], **moments}},
                    "param_groups": meta["param_groups"]})  # fmt: skip
        return int(meta["version"])

    def _mine(self, hf: Source) -> dict[str, torch.Tensor]:
        """This rank's Megatron tensors of full HF-layout tensors."""
        from megatron.core import parallel_state as ps

        from gyre.train.megatron.weights import stage_to_mcore

        return stage_to_mcore(hf, self.layout, tp_rank=ps.get_tensor_model_parallel_rank(),
                              tp_size=self.dims.tensor,
                              stage=ps.get_pipeline_model_parallel_rank(),
                              stages=self.dims.pipeline)  # fmt: skip

    def _shard_flat(self, flat: torch.Tensor, shapes: list[tuple[str, Any]]) -> torch.Tensor:
        """An HF flat buffer (parameters in `shapes` order) → this rank's flat buffer."""
        hf = core_file.views(flat, [[n, list(shape)] for n, shape in shapes])
        return self._flat(self._mine(hf)).to(self.cell.device)


def build(
    model: str, train: TrainConfig, dims: ParallelDims, *, core: bool, device: str,
    comms: Communicators | None = None, host: str = "127.0.0.1",
) -> MegatronReplica:  # fmt: skip
    """This rank's shard of the policy as a Megatron GPTModel, loaded from the HF model."""
    if comms is None:
        raise TrainingError("train.backend megatron: a cell rank needs its communicators")
    from gyre.train.comm import split_replicas
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import MegatronCell, ModelParallelOptimizer, build_rank_model
    from gyre.train.megatron.weights import WeightLayout

    # megatron-core warns at import and build about every optional CUDA library it lacks
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    # MPI's splits first: across nodes a split issued after torch's rendezvous thread has
    # run can wait on a peer still inside that rendezvous (seen: the netns Slurm test hung)
    split_replicas(comms, dims)  # collective over the cell, once
    place = dims.place(comms.shard)
    replica_comm = comms.cell.Split(place.data, comms.shard)
    stage_comm = replica_comm.Split(place.stage, place.tensor)
    init_backend_world(comms, host, "gloo" if device == "cpu" else "nccl")
    tokenizer, hf_config, generation, shard = _shard_source(model, dims, comms)
    mcfg = MegatronConfig(tensor_parallel=dims.tensor, pipeline_parallel=dims.pipeline,
                          sequence_parallel=dims.sequence, expert_parallel=dims.expert,
                          dtype=train.params_dtype,
                          moe_aux_loss_coeff=train.moe_aux_loss_coeff)  # fmt: skip
    # on its own device: Megatron's seeding there (CUDA) or the CPU patches, no random
    # init; the shard streamed in one tensor at a time
    gpt = build_rank_model(hf_config, shard, mcfg, device=device)
    _check_rank(comms, dims)
    cell = MegatronCell(gpt, objective=train.objective)
    optimizer = ModelParallelOptimizer(cell, train.optim) if core else None
    layout = WeightLayout.from_hf_config(hf_config, expert_parallel=dims.expert)
    return MegatronReplica(cell, tokenizer, optimizer, dims, comm=replica_comm, stage_comm=stage_comm,
                           data_rank=place.data, layout=layout, hf_config=hf_config,
                           generation=generation)  # fmt: skip


def _check_rank(comms: Communicators, dims: ParallelDims) -> None:
    """Megatron placed this rank where the cell's layout says (`ParallelDims.place`: TP rank
    s % TP of stage s // TP % PP, data-parallel rank cell x data + s // (TP x PP), expert-
    parallel rank (s % TP) // (TP / EP): the block of experts `WeightLayout` gave it)."""
    from megatron.core import parallel_state

    place = dims.place(comms.shard)
    assert comms.cell_id is not None
    want = (place.tensor, place.stage, comms.cell_id * dims.data + place.data)
    made = (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())  # fmt: skip
    if made != want:
        raise TrainingError(
            f"cell {comms.cell_id} rank {comms.shard}: Megatron made it tensor-parallel rank "
            f"{made[0]} of pipeline stage {made[1]}, data-parallel rank {made[2]}, not "
            f"{want[0]} of {want[1]}, {want[2]}; the cell's ranks must be contiguous in the "
            "backend world"
        )
    expert = place.tensor // (dims.tensor // dims.expert)
    if parallel_state.get_expert_model_parallel_rank() != expert:
        raise TrainingError(
            f"cell {comms.cell_id} rank {comms.shard}: Megatron made it expert-parallel rank "
            f"{parallel_state.get_expert_model_parallel_rank()}, not {expert}"
        )


def init_backend_world(comms: Communicators, host: str, backend: str) -> None:
    """torch.distributed over every cell rank (collective over `comms.cells`), rendezvous at
    the first cell rank's `host`; ranks numbered cell by cell, as Megatron's tensor-parallel
    groups need (a cell's ranks contiguous)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if dist.is_initialized():
        return
    me, size = comms.cells.Get_rank(), comms.cells.Get_size()
    store = None
    if me == 0:  # the store binds a free port itself: no other process can take it between
        # a port being chosen and bound (as one probed with a socket and closed could be)
        store = dist.TCPStore(host, 0, size, True, timeout=default_pg_timeout,
                              wait_for_workers=False)  # fmt: skip
    addr, port = comms.cells.bcast((host, store.port) if store is not None else None, root=0)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds the interface its host name resolves to: nodes that share a host name
        # (namespaces, containers) would all pick the same, often loopback, one
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(host)

    def init() -> None:
        joined = (
            store
            if store is not None
            else dist.TCPStore(addr, port, size, False, timeout=default_pg_timeout)
        )
        dist.init_process_group(backend, rank=me, world_size=size, store=joined)

    while_in_mpi(comms.cells, init)


def while_in_mpi(comm: Any, call: Callable[[], object]) -> None:
    """Run another library's collective rendezvous while this rank keeps MPI progressing.

    A netmod without asynchronous progress (MPICH's OFI over tcp, across nodes) moves a
    rank's queued messages only while that rank is inside MPI: a rank that blocks in
    torch's TCP rendezvous right after a broadcast can hold back the broadcast its peers
    still wait for (seen: ranks on other nodes stuck in the bcast, rank 0 in the store). So
    `call` runs on a thread while this one probes MPI until `call` returns — which, the
    rendezvous being collective, happens only once every rank has joined it, i.e. has
    everything MPI owed it."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # raised again on the calling thread
            failed.append(e)

    worker = threading.Thread(target=run, name="backend-rendezvous", daemon=True)
    worker.start()
    while worker.is_alive():
        comm.Iprobe()  # drives this rank's MPI progress
        worker.join(timeout=0.005)
    if failed:
        raise failed[0]


def interface_of(address: str) -> str:
    """The name of this machine's network interface holding `address` (`lo` for loopback)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise TrainingError(f"no network interface here holds {address}: the backend world's "
                        "rendezvous address must be this node's own")  # fmt: skip


def _shard_source(
    model: str, dims: ParallelDims, comms: Communicators
) -> tuple[Any, dict[str, Any], Any, Iterable[tuple[str, torch.Tensor]]]:
    """Collective over the cell: (tokenizer, HF config, generation config — the leader's,
    else None —, this rank's Megatron tensors, read one at a time as they are iterated; the
    model's `train.dtype` rounds them).

    Every rank, the leader too, reads only its slice of the model directory's safetensors
    files (`SafetensorsFiles`), so no rank holds the whole model or imports transformers'
    model code; the leader reads the tokenizer and configs. A model that is not a directory
    of safetensors files (the built-in `tiny` family, built from a config under a seed;
    SmolLM2, de-quantized from GGUF) exists only in the leader's memory, and is small: the
    leader loads it, cuts every rank's shard from it, scatters them and lets it go (a copy
    written to a temporary directory would be on the leader's node only, and a cell's
    stages may span nodes)."""
    from gyre.models import load_model, load_tokenizer, model_config
    from gyre.train.comm import arrive
    from gyre.train.megatron.shard_files import SafetensorsFiles
    from gyre.train.megatron.weights import WeightLayout, iter_stage_to_mcore

    hf = tokenizer = head = generation = None
    if comms.shard == 0:
        if SafetensorsFiles.find(model) is not None:
            tokenizer, generation = load_tokenizer(model), _generation_config(model)
            head = (model_config(model).to_dict(), True)
        else:
            hf, tokenizer = load_model(model)
            generation = hf.generation_config
            head = (hf.config.to_dict(), False)
    arrive(comms.cell)  # the other ranks sleep while the leader loads
    hf_config, files = comms.cell.bcast(head, root=0)
    layout = WeightLayout.from_hf_config(hf_config, expert_parallel=dims.expert)

    def slices(s: int, source: Any) -> Iterator[tuple[str, torch.Tensor]]:
        place = dims.place(s)
        return iter_stage_to_mcore(source, layout, tp_rank=place.tensor, tp_size=dims.tensor,
                                   stage=place.stage, stages=dims.pipeline)  # fmt: skip

    if not files:
        shard = _scattered(hf, slices, comms, dims.model_parallel)
        return tokenizer, hf_config, generation, shard
    # every rank holds the broadcast before the leader moves on to torch's rendezvous (a
    # netmod without asynchronous progress delivers only while the sender is inside MPI)
    arrive(comms.cell)
    return tokenizer, hf_config, generation, slices(comms.shard, SafetensorsFiles(Path(model)))


def _generation_config(model: str) -> Any:
    """The model directory's generation config (None where it has none)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model, local_files_only=True)
    except OSError:
        return None


def _scattered(
    hf: Any, slices: Callable[[int, Any], Iterator[tuple[str, torch.Tensor]]],
    comms: Communicators, model_parallel: int,
) -> Iterable[tuple[str, torch.Tensor]]:  # fmt: skip
    """Collective over the cell, for a model only the leader holds: the leader cuts every
    other rank's shard (`slices(rank, tensors)`, once per shard position: the data-parallel
    replicas get the same) from its model and scatters them."""
    from gyre.train.comm import arrive

    state = None if hf is None else dict(hf.state_dict())
    shards = None
    if state is not None:
        cut: dict[int, dict[str, torch.Tensor]] = {}
        for s in range(1, comms.cell.Get_size()):
            position = s % model_parallel
            if position not in cut:
                cut[position] = dict(slices(s, state))
        shards = [{} if s == 0 else cut[s % model_parallel] for s in range(comms.cell.Get_size())]
    received = comms.cell.scatter(shards, root=0)
    arrive(comms.cell)  # as after the broadcast: every rank holds its part
    return received.items() if state is None else slices(0, state)


def model_parallel(parallel: ParallelConfig, ranks_per_cell: int) -> ParallelDims:
    """Tensor x pipeline x data over all of a cell's ranks (`data` replicas of the model in
    the cell; data parallelism runs across cells too), sequence parallelism on by default
    beside tensor parallelism, expert parallelism folded onto the tensor-parallel ranks.
    Unset, data is what tensor and pipeline leave (1 where tensor is unset too)."""
    pipeline, tensor, data = parallel.pipeline, parallel.tensor, parallel.data
    if data is None:
        data = 1 if tensor is None else max(1, ranks_per_cell // (tensor * pipeline))
    if tensor is None:
        tensor = ranks_per_cell // (pipeline * data)
    if tensor < 1 or tensor * pipeline * data != ranks_per_cell:
        raise ConfigError(
            f"parallel: tensor {_yaml(parallel.tensor)} x pipeline {pipeline} x data "
            f"{_yaml(parallel.data)} != topology.ranks_per_cell {ranks_per_cell}; allowed: tensor x pipeline x data "
            "= ranks_per_cell (the Megatron backend lays a cell's model over all its ranks; "
            "null sizes are derived)"
        )
    if tensor % parallel.expert:
        raise ConfigError(
            f"parallel.expert: {parallel.expert} does not divide tensor {tensor}; allowed: a "
            f"divisor of tensor {tensor} (the Megatron backend folds a cell's experts onto its "
            "tensor-parallel ranks: expert x expert-tensor = tensor)"
        )
    sequence = parallel.sequence if parallel.sequence is not None else tensor > 1
    return ParallelDims(tensor=tensor, pipeline=pipeline, data=data, sequence=sequence,
                        expert=parallel.expert)  # fmt: skip


def _yaml(size: int | None) -> str:
    return "null" if size is None else str(size)


def check_installed() -> None:
    """megatron-core is importable here (the `megatron` extra)."""
    import importlib.util

    if importlib.util.find_spec("megatron.core") is None:
        raise ConfigError(
            "train.backend: megatron, but megatron-core is not installed here "
            "(pip install '.[megatron]'; on a GPU cluster '.[gpu]'); "
            "allowed here: torch"
        )


def check_model(hf_config: Mapping[str, Any], dims: ParallelDims) -> None:
    """The model's family, shapes over `dims` and RoPE are ones `build_gpt_model` lays out."""
    from gyre.train.megatron.config import MegatronConfig, check_trainable

    try:
        check_trainable(hf_config, MegatronConfig(tensor_parallel=dims.tensor,
                                                  pipeline_parallel=dims.pipeline,
                                                  sequence_parallel=dims.sequence,
                                                  expert_parallel=dims.expert))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{e} (or train.backend=torch)") from None


MEGATRON = TrainBackend(name="megatron", build=build, dims=model_parallel,
                        every_core_rank_steps=True, check_installed=check_installed,
                        check_model=check_model)  # fmt: skip
"""The Megatron backend: every core rank steps its own shard."""
