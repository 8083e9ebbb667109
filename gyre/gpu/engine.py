"""`python -m gyre.gpu.engine`: the embedded engine on a CUDA device (same protocol, same CLI).

    python -m gyre.gpu.engine --device cuda --dtype bfloat16 --model tiny --port 0

Arguments after `--device/--dtype` are `gyre engine`'s. The model is loaded, moved to the
device in the dtype, and served by `gyre.rollout.server` routes. Tensors the engine creates
per step follow `torch.set_default_device(device)`, which is per thread: it is set in the
IOLoop thread, in every executor thread (the loop's default executor is replaced by one
whose initializer sets it) and in the engine's worker thread. `CudaEngine` makes
`/release_memory_occupation` return device memory: the weights the engine parks are moved
to pinned host memory (tied weights stay tied) and the CUDA cache is emptied; `/resume_...`
moves them back.

For small models only: SGLang serves large ones (`gyre.rollout.serving`). Samplers'
generators are created on the model's device (`Engine.generator`); grammar masks are
computed on the host and moved to the logits' device (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from typing import Any

import torch

from gyre.gpu.memory import Placement, release_cached
from gyre.rollout import engine as engine_mod


class CudaEngine(engine_mod.Engine):
    """The embedded engine whose memory release frees device memory (its `device` is the
    model's, as placed before construction; samplers' generators live there too)."""

    def _loop(self) -> None:
        torch.set_default_device(self.device)  # the worker thread creates per-step tensors
        super()._loop()

    def release_memory(self) -> None:
        super().release_memory()
        with self.at_boundary():
            _move_snapshot(self._snapshot or [], "cpu")
        release_cached(self.device)

    def resume_memory(self) -> None:
        with self.at_boundary():
            _move_snapshot(self._snapshot or [], self.device)
        super().resume_memory()


def _move_snapshot(snapshot: list[tuple[Any, str, str, Any]], device: str) -> None:
    """Move the parked tensors in place (one copy per shared tensor: tied weights stay tied)."""
    moved: dict[int, Any] = {}
    pin = device == "cpu" and torch.cuda.is_available()
    for k, (module, kind, name, t) in enumerate(snapshot):
        if id(t) not in moved:
            data = t.data.to(device)
            if pin:
                data = data.pin_memory()
            new = (
                torch.nn.Parameter(data, requires_grad=t.requires_grad)
                if kind == "_parameters"
                else data
            )
            moved[id(t)] = new
        snapshot[k] = (module, kind, name, moved[id(t)])


def load_engine(config: engine_mod.Config, placement: Placement) -> CudaEngine:
    from gyre.models import load_model

    torch.set_num_threads(config.threads)
    model, tokenizer = load_model(config.model)
    placement.apply(model)
    return CudaEngine(config, model, tokenizer)


async def serve(config: Any, placement: Placement) -> None:
    """`gyre.rollout.server.serve`, with the model on `placement`."""
    from concurrent.futures import ThreadPoolExecutor

    from gyre.rollout import server

    torch.set_default_device(placement.device)
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(initializer=torch.set_default_device, initargs=(placement.device,))
    )
    await server.serve(config, functools.partial(load_engine, placement=placement))


def main(argv: list[str] | None = None) -> int:
    from gyre.rollout import cli

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cuda")
    pre.add_argument("--dtype", default="bfloat16")
    ours, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    placement = Placement(device=ours.device, dtype=ours.dtype)
    parser = argparse.ArgumentParser(prog="gyre.gpu.engine")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", *rest])
    asyncio.run(serve(cli.server_config(args), placement))
    return 0


if __name__ == "__main__":
    sys.exit(main())
