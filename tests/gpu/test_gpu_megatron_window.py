"""A window of micro-steps run 1F1B through a Megatron cell's pipeline stages updates the
cell exactly as the same micro-steps run one at a time (on CPU: gloo processes, the tiny
Qwen2, megatron-core's model and Gyre's CPU patches).

Each rank of a TP x PP world (`megatron_window_worker.py`) runs four micro-steps of
different widths, one execution's rows in two of them, first one at a time (each alone
through the stages, the path the single-micro-step CPU tests check against transformers),
then as one window; the ratio sums, the objective and target counts and every rank's
accumulated gradient must agree. At PP 2 and PP 2 x TP 2 (the tied embedding across the
stages, the vocab-parallel log-probs and the TP sums inside a window).
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import rendezvous

# each test starts a world of 2-4 Megatron worker processes (16-31 s here): not the --fast loop
pytestmark = pytest.mark.slow

if importlib.util.find_spec("megatron.core") is None:  # imported where used, not at collection
    pytest.skip("megatron-core not installed (extra gyre[gpu])", allow_module_level=True)
WORKER = Path(__file__).with_name("megatron_window_worker.py")
MICROSTEPS = 4


def _run(workers: Any, tmp_path: Path, tp: int, pp: int, order: str = "same") -> list[dict]:
    init, world = rendezvous(tmp_path), tp * pp
    procs = [subprocess.Popen(workers.command(WORKER, r, world, init, tmp_path, pp, MICROSTEPS,
                                              order),
                              env=workers.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _same(ranks: list[dict]) -> None:
    for r, got in enumerate(ranks):
        alone, window = got["alone"], got["window"]
        for a, w in zip(alone["sums"], window["sums"], strict=True):
            assert a.keys() == w.keys(), f"rank {r}"
            assert [a[e] for e in sorted(a)] == pytest.approx([w[e] for e in sorted(w)],
                                                                rel=1e-5, abs=1e-6)  # fmt: skip
        assert [s.targets for s in alone["stats"]] == [s.targets for s in window["stats"]]
        assert [s.objective for s in alone["stats"]] == pytest.approx(
            [s.objective for s in window["stats"]], rel=1e-5, abs=1e-6)  # fmt: skip
        assert float(alone["grads"].norm()) > 0
        torch.testing.assert_close(window["grads"], alone["grads"], rtol=1e-5, atol=1e-6)
        timing = window["timing"]
        assert timing is not None and 0 < timing.busy_s <= timing.wall_s


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)], ids=["pp2", "pp2xtp2"])
def test_a_window_run_1f1b_equals_its_micro_steps_one_at_a_time(
    workers: Any, tmp_path: Path, tp: int, pp: int
) -> None:
    _same(_run(workers, tmp_path, tp, pp))


def test_the_comparison_sees_a_window_out_of_order(workers: Any, tmp_path: Path) -> None:
    """The check above is not vacuous: the same window handed over in reverse gives each
    micro-step another's sums."""
    with pytest.raises(AssertionError):
        _same(_run(workers, tmp_path, 1, 2, order="reversed"))
