"""A Megatron cell publishes from the ranks that hold the weights: in a real 4-rank MPI world
(gloo), a core cell at TP 2 x PP 2 and at TP 1 x PP 2 x data 2 publishes the tiny model to
a real embedded engine with the cell's own `publish_parts`, through update groups (one per
stage sender) and by handle (`megatron_publish_worker.py`).

* Each pipeline stage's part leaves from that stage's TP rank 0 of data replica 0, and
  from no other rank: the leader sends only stage 0's tensors (the embedding and the first
  half of the layers), stage 1's sender only its layers and the final norm.
* The engine then serves exactly the one-process gather (`stages_to_hf` of every shard at
  the leader, loaded by value): the same greedy tokens and bit-equal log-probs.
* A reload of the leader's own engine (`reload_parts`: the core back in rollout, a resume)
  goes the same way, from the stages' senders.
* No request body carries weight bytes (a recording forwarder sees every body).
* The cell's policy directory (`policies.save_parts`) holds one safetensors file per stage,
  written by that stage's sender (file k: stage k's tensors, an index over them), and
  loads with `AutoModelForCausalLM.from_pretrained` as exactly the one-process gather.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:  # imported where used, not at collection
    pytest.skip("megatron-core not installed (extra gyre[gpu])", allow_module_level=True)
WORKER = Path(__file__).with_name("megatron_publish_worker.py")
BODY_LIMIT = 64 << 10  # a body above this carries weights (the tiny model is 1.3 MB)
LAYERS = 2  # the tiny model's


def _stage(name: str) -> int:
    """The pipeline stage (of 2) that holds HF tensor `name`."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // (LAYERS // 2)
    return 0 if name == "model.embed_tokens.weight" else 1


@pytest.mark.mpi
@pytest.mark.slow
def test_each_stage_publishes_its_own_weights_from_its_own_ranks(
    workers: Any, tmp_path: Path
) -> None:
    from gyre.models import load_model
    from gyre.rollout.testing import recording_forwarder, running_engine
    from gyre.runtime.cli import find_mpiexec

    hf, _ = load_model("tiny")
    assert hf.config.num_hidden_layers == LAYERS
    every = {n for n, _ in hf.named_parameters()}
    with running_engine("tiny") as url, recording_forwarder(url) as (watched, seen):
        proc = subprocess.run([find_mpiexec(), "-n", "4",
                               *workers.command(WORKER, watched, url, tmp_path)],
                              env=workers.env(), capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        errors = "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.error")))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + errors
    for layout, senders in (("tp2pp2d1", {0: 0, 2: 1}), ("tp1pp2d2", {0: 0, 1: 1})):
        records = [torch.load(tmp_path / f"{layout}-rank{r}.pt", weights_only=False)
                   for r in range(4)]  # fmt: skip
        for how in ("group", "handle", "reload"):
            sent = {r: rec["sent"][how] for r, rec in enumerate(records) if rec["sent"][how]}
            assert set(sent) == set(senders), (layout, how, sorted(sent))
            for r, stage in senders.items():  # a stage's tensors, from its own sender only
                assert {_stage(n) for n in sent[r]} == {stage}, (layout, how, r)
            assert sorted(n for names in sent.values() for n in names) == sorted(every)
            lead = records[0]
            assert lead["missed"][how] == [], (layout, how)
            tokens, logprobs, version = lead["published"][how]
            ref_tokens, ref_logprobs, _ = lead["reference"][how]
            assert version is not None and int(version) < 100  # not the reference's
            assert tokens == ref_tokens, (layout, how)
            assert logprobs == ref_logprobs, (layout, how)  # the same weights, exactly
        _check_policy(records[0], every)
    routes = {route for _, route, _ in seen}
    assert {"/update_weights_from_tensor", "/update_weights_from_distributed",
            "/init_weights_update_group"} <= routes  # fmt: skip
    heavy = [s for s in seen if s[2] > BODY_LIMIT]
    assert heavy == [], heavy


def _check_policy(lead: dict, every: set[str]) -> None:
    """The stages' files of the policy the cell wrote, loaded by transformers: the gather."""
    from transformers import AutoModelForCausalLM

    folder = Path(lead["policy"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert files == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    for name, file in index["weight_map"].items():  # file k: stage k's tensors
        assert file == files[_stage(name)], name
    assert set(index["weight_map"]) == every
    loaded = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    assert set(loaded) == set(lead["gathered"]) == every
    for name, t in lead["gathered"].items():
        assert torch.equal(loaded[name].detach(), t), name
