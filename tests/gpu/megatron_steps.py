"""The micro-step the Megatron CPU tests and their subprocess probes run: rows of random
tiny-vocabulary ids, the second half of each row a target (importable from tests/gpu, where
pytest and the probe scripts both put this folder on sys.path)."""

from __future__ import annotations

import numpy as np

from gyre.train.packing import MicroStep, TokenRow


def micro_step(lengths: tuple[int, ...] = (12, 7, 9)) -> MicroStep:
    gen = np.random.default_rng(0)
    rows = []
    for k, n in enumerate(lengths):
        targets = np.arange(n) >= n // 2
        rows.append(TokenRow(
            execution_id=f"e{k}", group_id="g0", policy_version=0,
            ids=gen.integers(0, 4096, n).astype(np.int64), targets=targets,
            behaviour_logprobs=np.where(targets, -1.0, 0.0), advantage=1.0,
            execution_targets=int(targets.sum()), weights=targets / targets.sum(),
        ))  # fmt: skip
    return MicroStep(index=0, rows=tuple(rows))
