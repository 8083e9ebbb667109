"""Standalone engines (`topology.standalone_engines`): ranks that only serve, never train.

On a resume a cell's engine gets the checkpoint's weights from its cell's ranks; a
standalone engine has no ranks of its own, so its leader reads the checkpoint's weights
itself (`checkpoint.load_weights`: the main weights alone, the optimizer state unread) and
loads them into its engine. What it then serves is checked token by token: every output
log-prob it recorded is the checkpoint's model's own (raw logits, T = 1) for that context.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gyre.trajectory.reader import TraceReader

pytestmark = [pytest.mark.mpi]


def test_a_resumed_standalone_engine_serves_the_checkpoints_weights(
    resumable_run: Path, tmp_path: Path
) -> None:
    from gyre.models import load_model
    from gyre.rollout.weights import load_named_tensors
    from gyre.runtime.shared import checkpoint
    from gyre.train import core_file

    run = tmp_path / "run"
    shutil.copytree(resumable_run, run)
    # the checkpoint's weights made a trained policy's (the fixture's are the initial model's,
    # which an engine that loaded nothing would serve as well)
    found = checkpoint.latest(run)
    assert found is not None
    data = core_file.load(found[0])
    gen = torch.Generator().manual_seed(0)
    trained = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in data["named"]]
    core_file.save(found[0], trained, data["optimizer"], int(data["version"]))

    done = subprocess.run(
        [sys.executable, "-m", "gyre", "run", "--resume", str(run), "topology.standalone_engines=1",
         "--steps", "5", "--quiet"],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

    cells = yaml.safe_load((run / "config.yaml").read_text())["topology"]["cells"]
    standalone = f"e{cells}"  # after the cells' engines, one each
    with TraceReader(run / "trace.h5") as r:
        served = [(tree, node) for tree in map(r.tree, (i.execution_id for i in r.executions()
                                                        if i.closed))
                  for node in tree.nodes
                  if node.engine_id == standalone and node.policy_version == 4]  # fmt: skip
    assert served, f"the standalone engine {standalone} served nothing after the resume"

    model, _ = load_model("tiny")
    load_named_tensors(model, trained)
    model.eval()
    worst = 0.0
    for tree, node in served[:8]:
        context = torch.as_tensor(tree.context_ids(node.node_id), dtype=torch.long)
        out = torch.as_tensor(node.output_ids, dtype=torch.long)
        with torch.no_grad():
            logits = model(torch.cat([context, out])[None]).logits[0].double()
        logp = torch.log_softmax(logits[len(context) - 1 : -1], -1)
        recomputed = logp.gather(-1, out[:, None]).squeeze(-1)
        recorded = torch.as_tensor(node.output_logprobs, dtype=torch.float64)
        worst = max(worst, float((recomputed - recorded).abs().max()))
    assert worst < 1e-4, f"the standalone engine's log-probs are not the checkpoint's: {worst}"
