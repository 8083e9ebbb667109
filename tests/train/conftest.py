"""Fixtures of the training-plane tests: a float64 tiny model, cells, the mpiexec binary."""

from __future__ import annotations

import copy
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny64_base() -> torch.nn.Module:
    """The deterministic tiny Qwen2 model in float64 (shared; copy before mutating)."""
    from gyre.models import load_model

    model, _ = load_model("tiny")
    return model.double()


@pytest.fixture
def tiny64(tiny64_base: torch.nn.Module) -> torch.nn.Module:
    """A private copy of the float64 tiny model."""
    return copy.deepcopy(tiny64_base)


def find_mpiexec() -> str:
    """The `mpich` wheel's mpiexec: next to this Python's scripts, else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found: pip install mpich (it installs bin/mpiexec)")
    return found


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """Path of the mpiexec binary used for real MPI worlds."""
    return find_mpiexec()


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
