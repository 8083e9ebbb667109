"""One place for the benches' memory measurement: a process's resident bytes and its peak.

    from peak_rss import reset_peak, peak_bytes, rss_bytes   # tools/ on sys.path
    before = rss_bytes(); reset_peak(); work(); extra = peak_bytes() - before

Linux only: the kernel's counters in /proc/self/status (VmRSS, and VmHWM, the high-water
mark, which `reset_peak` sets back to the current RSS through /proc/self/clear_refs).
Used by tools/bench_memory.py, tools/bench_shard_load.py and tools/bench_memory_plan.py;
`mpiexec` finds the launcher of their MPI worlds.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path


def kib(field: str) -> int:
    """/proc/self/status's `field` (VmRSS, VmHWM, ...) in KiB."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", text)
    assert match is not None, field
    return int(match.group(1))


def rss_bytes() -> int:
    """This process's resident memory now."""
    return kib("VmRSS") * 1024


def peak_bytes() -> int:
    """This process's peak resident memory since it started or since `reset_peak`."""
    return kib("VmHWM") * 1024


def peak_mb() -> float:
    """`peak_bytes` in MB (2**20 bytes)."""
    return kib("VmHWM") / 1024


def reset_peak() -> None:
    """Peak resident memory := current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


def mpiexec() -> str:
    """The mpiexec of the `mpich` wheel (bin/ next to this Python), else the one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    return str(here) if here.exists() else "mpiexec"
