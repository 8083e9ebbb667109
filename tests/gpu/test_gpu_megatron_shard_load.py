"""One shard per rank: a Megatron cell built by the runtime's `MEGATRON.build` in a real
2-rank MPI world (gloo), from a model directory of safetensors files (every rank reads its
slice) and from the built-in tiny model (the leader's scatter), at TP 2 and PP 2. Every
rank holds exactly `stage_to_mcore` of the whole model; no rank holds the whole model or,
from a model directory, imports transformers' model code (the leader reads the tokenizer and
configs only); the shards gathered back are the model unchanged, and the gather sends each rank's tensors, not its flat buffer once per tensor.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gyre.train.config import ParallelDims

if importlib.util.find_spec("megatron.core") is None:  # imported where used, not at collection
    pytest.skip("megatron-core not installed (extra gyre[gpu])", allow_module_level=True)
WORKER = Path(__file__).with_name("megatron_build_worker.py")


@pytest.mark.mpi
@pytest.mark.slow
def test_each_rank_of_a_built_cell_holds_exactly_its_slice(tmp_path: Path) -> None:
    from gyre.models import load_model
    from gyre.runtime.cli import find_mpiexec
    from gyre.train.megatron.weights import WeightLayout, stage_to_mcore

    hf, tok = load_model("tiny")
    model_dir = tmp_path / "tiny-dir"
    hf.save_pretrained(model_dir, max_shard_size="200KB")  # sharded: an index and its files
    tok.save_pretrained(model_dir)
    assert (model_dir / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(WORKER), str(model_dir),
                           str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    errors = "".join(p.read_text() for p in sorted(out.glob("rank*.error")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + errors
    full = {k: v.detach() for k, v in hf.state_dict().items()}
    layout = WeightLayout.from_hf_config(hf.config.to_dict())
    for tp, pp in ((2, 1), (1, 2)):
        for name in ("dir", "tiny"):
            for rank in range(2):
                got = torch.load(out / f"tp{tp}pp{pp}-{name}-rank{rank}.pt", weights_only=True)
                want = stage_to_mcore(full, layout, tp_rank=rank % tp, tp_size=tp,
                                      stage=rank // tp, stages=pp)  # fmt: skip
                assert set(got["tensors"]) == set(want), (tp, pp, name, rank)
                for k, t in want.items():
                    assert torch.equal(got["tensors"][k], t), (tp, pp, name, rank, k)
                if rank == 0:  # the shards gathered back: the same weights
                    assert set(got["gathered"]) == {n for n, _ in hf.named_parameters()}
                    assert all(torch.equal(t, full[k]) for k, t in got["gathered"].items())
                if rank > 0 or (tp, pp, name) == (2, 1, "dir"):  # before any `tiny` build
                    assert not got["qwen2_code"], (tp, pp, name, rank, "loaded the HF model")


class _Comm:
    """A one-rank cell communicator that records how many bytes a gather pickles."""

    def __init__(self) -> None:
        self.sent = 0

    def gather(self, obj: object, root: int) -> list[object]:
        self.sent += len(pickle.dumps(obj))
        return [obj]


def test_a_gather_sends_each_tensor_not_its_flat_buffer() -> None:
    """`_gather` pickles each view's own elements (a pickled view carries its whole storage:
    on CPU that was the rank's flat buffer once per tensor)."""
    from gyre.train.backends.megatron import MegatronReplica
    from gyre.train.megatron.weights import WeightLayout

    layout = WeightLayout(num_layers=1, heads=2, groups=1, head_dim=4, qkv_bias=False, tied=True)
    hidden, ffn, vocab = 8, 16, 32
    shapes = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "decoder.layers.0.input_layernorm.weight": (hidden,),
        "decoder.layers.0.pre_mlp_layernorm.weight": (hidden,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (16, hidden),
        "decoder.layers.0.self_attention.linear_proj.weight": (hidden, hidden),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * ffn, hidden),
        "decoder.layers.0.mlp.linear_fc2.weight": (hidden, ffn),
        "decoder.final_layernorm.weight": (hidden,),
    }
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes.values()))
    views, off = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        views[name] = flat[off : off + n].view(shape)
        off += n
    comm = _Comm()
    me = SimpleNamespace(
        comm=comm, layout=layout, dims=ParallelDims(tensor=1, pipeline=1, data=1), data_rank=0
    )
    hf = MegatronReplica._gather(me, views)  # type: ignore[arg-type]
    assert hf is not None and torch.equal(hf["model.embed_tokens.weight"], views[
        "embedding.word_embeddings.weight"])  # fmt: skip
    assert comm.sent < 1.5 * flat.nbytes + 10_000
