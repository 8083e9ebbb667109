"""A cell rank's training replica, by training backend (`train.backend`, docs/gpu.md).

The backend seam of the training plane: a named builder per backend (`BACKENDS`), chosen by
the run config, returns a `Replica` — the rank's `TorchCell` (flat parameter and gradient
buffers, the two passes of the objective), the tokenizer, the core's optimizer where this
rank owns one, and the cell's parallel sizes (`ParallelDims`). The cell's protocol
(`gyre.runtime.cell.trainer.CellTrainer`) is the same for every backend; what differs is asked of
the replica:

* **torch** — every rank of a cell holds the whole model (data parallel inside the cell):
  a pass's rows are split over the ranks, the leader's optimizer steps the cell's summed
  gradient; the leader's model *is* the Hugging Face policy.
* **megatron** — megatron-core's GPTModel sharded over the cell's ranks with tensor and
  pipeline parallelism (torch.distributed over the cell ranks: gloo on CPU, NCCL on GPU;
  the CPU patches of `gyre.train.megatron.cpu`; rank s of a cell is TP rank s % TP of
  stage s // TP). Every rank runs every row (the stages one after the other); each core
  rank steps AdamW on its own shard with the whole model's gradient norm. After every
  change of weights (an update, a pull of the core's snapshot, a restore) the shards of
  every stage are gathered to the leader into a Hugging Face *mirror* of the policy: what
  the engines load, policies save and checkpoints keep.

    replica = build_replica(cfg, core=True, comms=comms, host="10.0.0.5")
    replica.named()            # the leader: HF-layout weights of the version held
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gyre.errors import TrainingError
from gyre.runtime.shared import checkpoint
from gyre.runtime.shared.config import RunConfig
from gyre.train.cell import CoreOptimizer, TorchCell
from gyre.train.comm import Communicators
from gyre.train.config import ParallelDims

Named = list[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class Replica:
    """The torch backend's replica: the whole model on this rank (data parallel in a cell)."""

    cell: TorchCell
    tokenizer: Any
    optimizer: CoreOptimizer | None = None
    dims: ParallelDims = field(default_factory=lambda: ParallelDims(tensor=1, pipeline=1, data=1))

    @property
    def policy_model(self) -> Any:
        """The Hugging Face model of the weights held (the leader's): saved as a policy."""
        return self.cell.model

    def named(self) -> Named:
        """The leader's HF-layout weights (what engines load)."""
        return [(n, p.detach()) for n, p in self.policy_model.named_parameters()]

    def refresh(self) -> None:
        """After the weights changed (collective over the cell): the torch replica is its
        own policy model, nothing to gather."""

    def hf_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        """A flat buffer (parameters or gradients) in the HF model's flat order, on the
        leader (collective over the cell)."""
        return flat

    def optimizer_state(self) -> dict[str, Any] | None:
        """The core's AdamW state dict with its moments in the HF model's flat order, on the
        leader (collective over a model-parallel core); None without an optimizer."""
        return self.optimizer.opt.state_dict() if self.optimizer is not None else None

    def save(self, folder: Path, version: int, shard: int) -> int:
        """This rank's part of a checkpoint (the leader writes it); bytes written."""
        state = self.optimizer_state()
        if shard != 0:
            return 0
        return checkpoint.save_core(folder, self.named(), state, version)

    def restore(self, run_dir: Path, shard: int) -> int:
        """Load the newest checkpoint into this rank's replica; returns its version."""
        return checkpoint.restore_replica(run_dir, self.cell.model, self.optimizer)


@dataclass(slots=True)
class MegatronReplica(Replica):
    """The Megatron backend's replica: this rank's tensor-parallel shard of its pipeline
    stage of the model."""

    comm: Any = None  # the cell's MPI communicator (shard gathers to the leader)
    mirror: Any = None  # the leader's Hugging Face model of the same weights (else None)
    layout: Any = None  # gyre.train.megatron.weights.Layout of the model

    @property
    def policy_model(self) -> Any:
        if self.mirror is None:
            raise TrainingError("megatron replica: only a cell's leader holds the HF policy")
        return self.mirror

    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Every rank's shard tensors → the HF-layout tensors on the leader."""
        from gyre.train.megatron.weights import stages_to_hf

        shards = self.comm.gather({k: v.detach().cpu() for k, v in tensors.items()}, root=0)
        return None if shards is None else stages_to_hf(shards, self.layout,
                                                        tp_size=self.dims.tensor)  # fmt: skip

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flat buffer's slice of every trainable parameter, by Megatron name."""
        out, off = {}, 0
        for name, p in self.cell.model.named_parameters():
            if p.requires_grad:
                out[name] = flat[off : off + p.numel()].view_as(p)
                off += p.numel()
        return out

    def refresh(self) -> None:
        from gyre.rollout.weights import load_named_tensors

        hf = self._gather(self._views(self.cell.flat_params))
        if hf is not None:
            load_named_tensors(self.mirror, sorted(hf.items()))

    def hf_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        hf = self._gather(self._views(flat))
        if hf is None:
            return None
        names = [n for n, p in self.mirror.named_parameters() if p.requires_grad]
        return torch.cat([hf[n].reshape(-1) for n in names])

    def optimizer_state(self) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        state = self.optimizer.opt.state_dict()  # its per-parameter dicts are the live ones
        if 0 in state["state"]:
            moments = dict(state["state"][0])
            for key in ("exp_avg", "exp_avg_sq"):  # elementwise: laid out like the weights
                if key in moments:
                    moments[key] = self.hf_flat(moments[key])
            state["state"] = {**state["state"], 0: moments}
        return state

    def restore(self, run_dir: Path, shard: int) -> int:
        """Weights and AdamW moments from an HF-layout checkpoint (either backend's, any TP
        and PP sizes), split to this rank's shard of its stage."""
        from gyre.rollout.weights import load_named_tensors

        data = checkpoint.load_core(run_dir)
        if data is None:
            return 0
        named = dict(data["named"])
        if self.mirror is not None:
            load_named_tensors(self.mirror, sorted(named.items()))
        load_named_tensors(self.cell.model, sorted(self._shard(named).items()))
        state = data["optimizer"]
        if self.optimizer is not None and state is not None:
            shapes = [(n, t.shape) for n, t in data["named"]]
            moments = state["state"].get(0, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments:
                    moments[key] = self._shard_flat(moments[key], shapes)
            self.optimizer.opt.load_state_dict(state)
        return int(data["version"])

    def _shard(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's Megatron tensors of full HF-layout tensors."""
        from megatron.core import parallel_state as ps

        from gyre.train.megatron.weights import stage_to_mcore

        return stage_to_mcore(hf, self.layout, tp_rank=ps.get_tensor_model_parallel_rank(),
                              tp_size=self.dims.tensor,
                              stage=ps.get_pipeline_model_parallel_rank(),
                              stages=self.dims.pipeline)  # fmt: skip

    def _shard_flat(self, flat: torch.Tensor, shapes: list[tuple[str, Any]]) -> torch.Tensor:
        """An HF flat buffer (parameters in `shapes` order) → this rank's flat buffer."""
        hf, off = {}, 0
        for name, shape in shapes:
            n = int(torch.Size(shape).numel())
            hf[name] = flat[off : off + n].view(shape)
            off += n
        mine = self._shard(hf)
        return torch.cat([mine[n].reshape(-1) for n, p in self.cell.model.named_parameters()
                          if p.requires_grad]).to(self.cell.device)  # fmt: skip


def build_replica(
    cfg: RunConfig, core: bool, comms: Communicators | None = None, host: str = "127.0.0.1",
    device: str | None = None,
) -> Replica:  # fmt: skip
    """A cell rank's training replica, built by `cfg.train.backend`'s builder (`BACKENDS`) on
    `device` (its placement; default `train.device`); `core`: this rank is one the core's
    optimizer runs on (torch: the core's leader; megatron: every core rank); `comms` and
    `host` (the rank's address) for a backend with a process-group world of its own."""
    build = BACKENDS[cfg.train.backend]
    return build(cfg, core=core, comms=comms, host=host, device=device or cfg.train.device)


def build_torch_replica(
    cfg: RunConfig, *, core: bool, comms: Communicators | None, host: str, device: str
) -> Replica:
    """The whole Hugging Face model on this rank (the cell's ranks are data parallel)."""
    from gyre.models import load_model

    model, tokenizer = load_model(cfg.model)
    module: torch.nn.Module = model
    module.to(torch.device(device)).train()
    cell = TorchCell(model, objective=cfg.train.objective)
    optimizer = CoreOptimizer(cell, cfg.train.optim) if core else None
    return Replica(cell, tokenizer, optimizer, cfg.dims)


def init_backend_world(comms: Communicators, host: str, backend: str) -> None:
    """torch.distributed over every cell rank (collective over `comms.cells`), rendezvous at
    the first cell rank's `host`; ranks numbered cell by cell, as Megatron's tensor-parallel
    groups need (a cell's ranks contiguous)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    me = comms.cells.Get_rank()
    port = None
    if me == 0:
        with socket.socket() as s:  # a free port on the rendezvous host
            s.bind((host, 0))
            port = s.getsockname()[1]
    addr, port = comms.cells.bcast((host, port) if me == 0 else None, root=0)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds the interface its host name resolves to: nodes that share a host name
        # (namespaces, containers) would all pick the same, often loopback, one
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(host)
    init = functools.partial(dist.init_process_group, backend, rank=me,
                             init_method=f"tcp://{addr}:{port}",
                             world_size=comms.cells.Get_size())  # fmt: skip
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


def build_megatron_replica(
    cfg: RunConfig, *, core: bool, comms: Communicators | None, host: str, device: str
) -> MegatronReplica:
    """This rank's shard of the policy as a Megatron GPTModel, loaded from the HF model."""
    if comms is None:
        raise TrainingError("train.backend megatron: a cell rank needs its communicators")
    from gyre.rollout.weights import load_named_tensors
    from gyre.train.megatron.config import MegatronConfig
    from gyre.train.megatron.model import (
        MegatronCell,
        ModelParallelOptimizer,
        build_gpt_model,
        init_model_parallel,
    )
    from gyre.train.megatron.weights import Layout

    # megatron-core warns at import and build about every optional CUDA library it lacks
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    dims = cfg.dims
    init_backend_world(comms, host, "gloo" if device == "cpu" else "nccl")
    hf, tokenizer, hf_config, dtype, shard = _leaders_model(cfg, comms)
    mcfg = MegatronConfig(tensor_parallel=dims.tensor, pipeline_parallel=dims.pipeline,
                          dtype=dtype)  # type: ignore[arg-type]  # fmt: skip
    init_model_parallel(mcfg)
    from megatron.core import parallel_state

    tp_rank, stage = comms.shard % dims.tensor, comms.shard // dims.tensor
    made = (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank())  # fmt: skip
    if made != (tp_rank, stage):
        raise TrainingError(
            f"cell {comms.cell_id} rank {comms.shard}: Megatron made it tensor-parallel rank "
            f"{made[0]} of pipeline stage {made[1]}, not {tp_rank} of {stage}; the cell's ranks "
            "must be contiguous in the backend world"
        )
    model = build_gpt_model(hf_config, mcfg, device="cpu")
    load_named_tensors(model, sorted(shard.items()))
    model.to(torch.device(device)).train()
    cell = MegatronCell(model, objective=cfg.train.objective)
    optimizer = ModelParallelOptimizer(cell, cfg.train.optim) if core else None
    return MegatronReplica(cell, tokenizer, optimizer, dims, comm=comms.cell, mirror=hf,
                           layout=Layout.from_hf_config(hf_config))  # fmt: skip


def _leaders_model(
    cfg: RunConfig, comms: Communicators
) -> tuple[Any, Any, dict[str, Any], str, dict[str, torch.Tensor]]:
    """Collective over the cell: (HF model, tokenizer, HF config, dtype, this rank's Megatron
    tensors). Only the leader loads the Hugging Face model (it keeps it as the mirror; the
    others get None): it sends the config and each rank's shard, so the other ranks never
    import transformers' model code (seconds of CPU each at start-up) nor hold the whole
    model."""
    from gyre.models import load_model
    from gyre.train.comm import arrive
    from gyre.train.megatron.weights import Layout, stage_to_mcore

    dims, leader = cfg.dims, comms.shard == 0
    hf = tokenizer = shards = head = None
    if leader:
        hf, tokenizer = load_model(cfg.model)
        head = (hf.config.to_dict(), str(next(hf.parameters()).dtype).removeprefix("torch."))
        layout, state = Layout.from_hf_config(head[0]), dict(hf.state_dict())
        shards = [{k: v.detach().clone() for k, v in stage_to_mcore(
                      state, layout, tp_rank=s % dims.tensor, tp_size=dims.tensor,
                      stage=s // dims.tensor, stages=dims.pipeline).items()}
                  for s in range(comms.cell.Get_size())]  # fmt: skip
    arrive(comms.cell)  # the other ranks sleep while the leader loads
    hf_config, dtype = comms.cell.bcast(head, root=0)
    shard = comms.cell.scatter(shards, root=0)
    # every rank holds its part before the leader moves on to torch's rendezvous (a netmod
    # without asynchronous progress delivers only while the sender is inside MPI)
    arrive(comms.cell)
    return hf, tokenizer, hf_config, dtype, shard


BACKENDS: dict[str, Callable[..., Replica]] = {
    "torch": build_torch_replica,
    "megatron": build_megatron_replica,
}
"""Training backends by `train.backend`: each builds a rank's `Replica` from the run config."""
