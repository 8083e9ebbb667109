"""`gyre run` publishing through the update-group path (`engine.publication: distributed`).

The 2-step local run (templates/local.yaml, three single-rank cells, about 70 s on 2 cores)
publishes each new policy through one gloo update group per publication: the core at rank 0,
the three embedded engines at ranks 1..3. A publication is not missed only when every engine
loaded the broadcast tensors and then reported the published `weight_version` on
/model_info (`EngineClient.confirm_version` checks it after `update_weights_from_distributed`),
so the trace's `publish` events with no engine missed show each engine serving each version;
each engine's log names the group it joined for each publication (the publication's targets:
the engines that serve while the core trains; the core's own engine is brought up to date
when it returns). (A 2-step run publishes once: the last step's policy is saved, not
published.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.errors import ConfigError
from gyre.runtime.shared.config import EngineConfig
from gyre.trajectory.store import TraceReader

REPO = Path(__file__).resolve().parents[2]


def test_the_path_is_chosen_by_config_or_by_size() -> None:
    auto = EngineConfig(distributed_above_mb=100)
    assert not auto.distributed(100_000_000) and auto.distributed(100_000_001)
    assert EngineConfig(publication="distributed").distributed(1)
    assert not EngineConfig(publication="http").distributed(10**12)
    with pytest.raises(ConfigError, match=r"engine\.publication: 'nccl'; allowed: http"):
        EngineConfig(publication="nccl")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="distributed_above_mb: -1"):
        EngineConfig(distributed_above_mb=-1)


@pytest.mark.mpi
@pytest.mark.slow
def test_gyre_run_publishes_through_update_groups(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "gyre", "run", str(REPO / "templates" / "local.yaml"),
         "--steps", "2", "engine.publication=distributed", "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    with TraceReader(run_dir / "trace.h5") as r:
        events = [(e["kind"], json.loads(e["detail"])) for e in r.rows("events")]
    published = [d for kind, d in events if kind == "publish"]
    assert published and all(d["missed"] == [] for d in published), published
    joins: dict[int, list[tuple[int, int]]] = {}  # version -> (rank, world) of each engine
    for cell in range(3):
        log = (run_dir / "logs" / f"engine-cell{cell}.log").read_text()
        pattern = r"joined update group gyre_weights_v(\d+)_\d+ at rank (\d+) of (\d+)"
        for v, rank, world in re.findall(pattern, log):
            joins.setdefault(int(v), []).append((int(rank), int(world)))
    assert sorted(joins) == [d["version"] for d in published], joins
    for members in joins.values():  # the core is rank 0; each target engine joined once
        world = members[0][1]
        assert world >= 2 and sorted(members) == [(r, world) for r in range(1, world)], members
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["publications"] == len(published)
