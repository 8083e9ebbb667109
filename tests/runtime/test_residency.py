"""A colocated trainer leaves its GPU on every switch to rollout, through the code a job runs.

A cell leader is built as `gyre run` builds it (`gyre.runtime.roles`: its role, the snapshot
transport over what the role shares, `gyre.runtime.cell.leader.CellProcess` over both; only
the engine's process is a stub) with a residency whose "device" is the CPU, and driven
through the loop's own handlers (ToTrain, Accumulate, Reduce, ToRollout). On the CPU a park
makes the same moves as on a GPU — a new host buffer for every training buffer — so the
checks hold there: after `ToRollout` no training buffer is referenced any more (weak
references to their storages die), a restore allocates each buffer once and keeps no host
copy, the engine starts only after the trainer parked, and training across a park and
restore is bitwise the training without one.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from gyre.runtime import roles
from gyre.runtime.cell.leader import CellProcess
from gyre.runtime.cell.residency import TrainerResidency, move_tensor
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import DEFAULT_CONFIG, load_run_config
from gyre.runtime.shared.layout import Component
from gyre.runtime.shared.placement import RankDevice
from gyre.runtime.shared.startup import StartupClock
from gyre.train.comm import Communicators
from gyre.train.objective import ExecutionScalar
from gyre.train.packing import MicroStep, pack_rows
from gyre.train.synthetic import random_batch
from gyre.train.transfer import make_transport


class StubEngine:
    """What a leader's switches ask of its engine (`EngineHost`), without a process."""

    url, host = "http://stub", "127.0.0.1"

    def __init__(self) -> None:
        self.released, self.version = False, 0

    def dead(self) -> int | None:
        return None

    def release(self) -> None:
        self.released = True

    def resume(self) -> None:
        self.released = False


class Moves:
    """The real mover (`move_tensor`), keeping a weak reference to the storage of every
    tensor it moved away from: the trainer's buffers as built, then each switch's."""

    def __init__(self) -> None:
        self.left: dict[str, StorageWeakRef] = {}

    def __call__(self, what: str, t: torch.Tensor, device: str) -> torch.Tensor:
        self.left[f"{what} (move {len(self.left)})"] = StorageWeakRef(t.untyped_storage())
        return move_tensor(what, t, device)


class Sent(list[msg.Message]):
    """The leader's link to the coordinator: keeps what it sends."""

    def send(self, m: msg.Message, dest: int) -> None:
        self.append(m)


@dataclass
class Leader:
    """A core cell's leader rank, built and wired as a job builds it."""

    role: Any
    cell: CellProcess
    transport: Any
    residency: TrainerResidency | None
    order: list[str] = field(default_factory=list)  # "build", "engine (parked: ...)"

    @property
    def replica(self) -> Any:
        return self.role.replica

    def handle(self, m: msg.Message) -> None:
        self.cell.handlers[type(m)](m)


@pytest.fixture
def leaders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Build leaders: `make(park)` — with `park` a colocated trainer on a CPU "device"."""
    order: list[str] = []
    build = roles._build_replica

    def built(*args: Any) -> Any:
        order.append("build")
        return build(*args)

    monkeypatch.setattr(roles, "_build_replica", built)
    made: list[Leader] = []

    def make(park: bool) -> Leader:
        cfg = load_run_config(DEFAULT_CONFIG)
        me = Component("cell", 0, 0)
        residency = TrainerResidency(device="cpu", move=Moves()) if park else None
        wiring = roles.Wiring(
            components=[me], comms=Communicators.alone(cell_id=0), address="127.0.0.1",
            link=None, hosts=["here"], placed=RankDevice(0, me, "cpu", offload=park),
            residency=residency, clock=StartupClock({}), parks_first=park,
        )  # fmt: skip
        order.clear()

        def start_engine(*args: Any) -> StubEngine:
            order.append(f"engine (parked: {residency.released if residency else None})")
            return StubEngine()

        monkeypatch.setattr(roles, "_start_engine", start_engine)
        run_dir = tmp_path / f"run{len(made)}"
        role = roles.ROLES["cell"](cfg, wiring, me, run_dir)
        from mpi4py import MPI

        transport = make_transport("mpi", MPI.COMM_SELF, core_ranks=[0], shard=0, flat=role.flat)
        cell = CellProcess(cfg, engine_index=0, comms=wiring.comms, run_dir=run_dir,
                           engine=role.engine, replica=role.replica, transport=transport,
                           version=role.version, residency=residency)  # fmt: skip
        cell.link = Sent()  # type: ignore[assignment]
        made.append(Leader(role, cell, transport, residency, list(order)))
        return made[-1]

    yield make
    for leader in made:
        leader.transport.close()


def _batch(seed: int) -> tuple[list[MicroStep], dict[str, ExecutionScalar]]:
    """Micro-steps of a random batch of 3 executions for the tiny model, and their scalars."""
    rows, info = random_batch(np.random.default_rng(seed), executions=3, vocab=4096,
                              length=(6, 20))  # fmt: skip
    steps = pack_rows(rows, token_budget=64)
    scalars = {r.execution_id: ExecutionScalar(advantage=r.advantage,
                                               num_targets=r.execution_targets,
                                               log_ratio=0.0, gate=1.0) for r in rows}  # fmt: skip
    assert len(info.executions) == 3 and len(steps) >= 2
    return steps, scalars


def _accumulate(leader: Leader, step: MicroStep, scalars: dict[str, ExecutionScalar]) -> None:
    leader.handle(msg.Accumulate(batch=0, version=leader.cell.version, steps=(step,),
                                 scalars=scalars))  # fmt: skip


def _training_tensors(replica: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the trainer that lives on its device while it trains, by name."""
    cell, opt = replica.cell, replica.optimizer
    out = {"flat_params": cell.flat_params, "flat_grads": cell.flat_grads}
    for name, p in cell.model.named_parameters():
        out[f"param {name}"] = p
        assert p.grad is not None
        out[f"grad {name}"] = p.grad
    for key, value in opt.opt.state[opt._param].items():
        if value.dim() > 0:
            out[f"optimizer {key}"] = value
    return out


def _weak(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Weak references to each tensor's storage (views keep a storage alive) and to each
    tensor but the parameters (the model's own objects: they stay, re-viewed elsewhere)."""
    refs: dict[str, Any] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.nn.Parameter):
            refs[name] = weakref.ref(t)
        refs[f"{name} (storage)"] = StorageWeakRef(t.untyped_storage())
    return refs


def _alive(refs: dict[str, Any]) -> list[str]:
    gc.collect()
    return [n for n, r in refs.items()
            if (not r.expired() if isinstance(r, StorageWeakRef) else r() is not None)]  # fmt: skip


class Allocations(TorchDispatchMode):
    """The bytes of every new storage an aten op makes (not a view of one of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr()
                  for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.made.append((str(func), t.untyped_storage().nbytes()))
        return out


def test_the_engine_starts_once_the_trainer_parked(leaders: Any) -> None:
    """A trainer sharing its GPU is built and parked before its cell's engine starts (the
    engine then finds the memory free); one that does not builds while the engine loads."""
    assert leaders(park=True).order == ["build", "engine (parked: True)"]
    assert leaders(park=False).order == ["engine (parked: None)", "build"]


def test_after_to_rollout_nothing_holds_the_trainers_buffers(leaders: Any) -> None:
    """The role, the snapshot transport, the model's parameter views, the optimizer: none of
    them keeps a training buffer once the cell switched to rollout — neither the buffers
    the trainer was built in nor those it trained in."""
    leader = leaders(park=True)
    steps, scalars = _batch(0)
    leader.handle(msg.ToTrain())
    _accumulate(leader, steps[0], scalars)
    leader.handle(msg.Reduce(batch=0, cells=1, num_executions=3))  # AdamW moments exist
    _accumulate(leader, steps[1], scalars)  # a switch may come with gradients accumulated
    training = _training_tensors(leader.replica)
    assert {"optimizer exp_avg", "optimizer exp_avg_sq"} <= set(training)
    refs = _weak(training)
    del training
    leader.handle(msg.ToRollout(published=0))
    assert leader.residency is not None and leader.residency.released
    assert isinstance(leader.residency.move, Moves)
    assert len(leader.residency.move.left) == 2 + 2 + 4  # built: flat, grads; then both ways
    assert _alive({**refs, **leader.residency.move.left}) == []
    assert leader.role.flat.device.type == "meta"  # what the transport was built over


def test_a_restore_allocates_each_buffer_once_and_keeps_no_host_copy(leaders: Any) -> None:
    leader = leaders(park=True)
    steps, scalars = _batch(1)
    leader.handle(msg.ToTrain())
    _accumulate(leader, steps[0], scalars)
    leader.handle(msg.Reduce(batch=0, cells=1, num_executions=3))
    leader.handle(msg.ToRollout(published=0))
    parked = _training_tensors(leader.replica)
    sizes = sorted(t.untyped_storage().nbytes() for n, t in parked.items()
                   if not n.startswith(("param ", "grad ")))  # fmt: skip
    host = _weak(parked)
    del parked
    with Allocations() as counted:
        leader.handle(msg.ToTrain())
    assert sorted(n for _, n in counted.made) == sizes  # flat, grads, exp_avg, exp_avg_sq
    assert len(sizes) == 4
    assert _alive(host) == []  # the parked host copies are gone
    training = _training_tensors(leader.replica)
    storages = {t.untyped_storage().data_ptr() for t in training.values()}
    assert len(storages) == 4  # every parameter and gradient a view of the two flat buffers


def test_training_across_a_park_and_restore_is_bitwise_the_training_without_one(
    leaders: Any,
) -> None:
    """Two batches, with a switch to rollout and back in the middle of the second (its
    first micro-step's gradient accumulated): the same weights, moments, reported norms and
    snapshot as a cell that never parked."""
    parked, stays = leaders(park=True), leaders(park=False)
    for leader in (parked, stays):
        leader.handle(msg.ToTrain())
        for batch in range(2):
            steps, scalars = _batch(10 + batch)
            for k, step in enumerate(steps):
                if batch == 1 and k == 1:
                    leader.handle(msg.ToRollout(published=0))
                    leader.handle(msg.ToTrain())
                _accumulate(leader, step, scalars)
            leader.handle(msg.Reduce(batch=batch, cells=1, num_executions=3))
    a, b = _training_tensors(parked.replica), _training_tensors(stays.replica)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    norms = [[m.grad_norm for m in leader.cell.link if isinstance(m, msg.Updated)]  # type: ignore[attr-defined]
             for leader in (parked, stays)]  # fmt: skip
    assert norms[0] == norms[1] and len(norms[0]) == 2
    pulled = torch.zeros_like(a["flat_params"])
    parked.transport.pull(pulled)  # the window was refreshed from the restored buffer
    assert torch.equal(pulled, a["flat_params"])


def test_the_switch_to_rollout_reports_what_the_trainer_parked(leaders: Any) -> None:
    """The Switched message (the trace's switch event, which the GPU check reads) carries
    the park: the bytes of every training buffer moved to the host (flat weights, gradients,
    both AdamW moments) and the device's allocated bytes before and after (0 on a CPU rank;
    on a GPU the after is what the engine finds)."""
    leader = leaders(park=True)
    steps, scalars = _batch(2)
    leader.handle(msg.ToTrain())
    _accumulate(leader, steps[0], scalars)
    leader.handle(msg.Reduce(batch=0, cells=1, num_executions=3))
    training = _training_tensors(leader.replica)
    nbytes = sum(t.untyped_storage().nbytes() for n, t in training.items()
                 if not n.startswith(("param ", "grad ")))  # fmt: skip
    del training
    leader.handle(msg.ToRollout(published=0))
    switched = [m for m in leader.cell.link if isinstance(m, msg.Switched)][-1]
    assert switched.role.value == "rollout"
    assert switched.detail["trainer_parked_bytes"] == nbytes > 0
    assert (
        switched.detail["device_allocated_before"] == switched.detail["device_allocated_after"] == 0
    )
