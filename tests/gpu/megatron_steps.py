"""The micro-step the Megatron CPU tests and their subprocess probes run: rows of random
tiny-vocabulary ids, the second half of each row a target (importable from tests/gpu, where
pytest and the probe scripts both put this folder on sys.path)."""

from __future__ import annotations

import numpy as np

from gyre.train.packing import MicroStep
from gyre.train.synthetic import random_step


def micro_step(lengths: tuple[int, ...] = (12, 7, 9)) -> MicroStep:
    return random_step(np.random.default_rng(0), lengths, vocab=4096)
