"""Fixtures for trace tests: the shared end-to-end run's directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from worlds import World


@pytest.fixture
def run_dir(e2e_run: World) -> Path:
    """The shared end-to-end run (tests/worlds.py)."""
    assert e2e_run.returncode == 0, e2e_run.output[-3000:]
    return e2e_run.run_dir
