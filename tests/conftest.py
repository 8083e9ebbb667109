"""Suite-wide test settings: offline, single-threaded math, no stray network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# shared test helpers (`import processes`) and the train tests' reference (`train.reference`)
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
