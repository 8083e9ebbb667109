"""Check, inside the batch script, that the allocation is the one the config asks for, and
run the preflight where the job runs (`Where.JOB`: its programs, its model, its run directory).

`slurm/gyre.sbatch` carries the `#SBATCH hetjob` blocks of the config it was rendered from;
run with another config (`sbatch slurm/gyre.sbatch other.yaml`) the world would not match the
topology. The script runs this first and stops with the `gyre render` command to use:

    python -m gyre.launch.check CONFIG      # exit 0, or 2 with a message on stderr
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from gyre.errors import ConfigError, exit_status
from gyre.launch.spec import JobSpec, job_spec, load_launch
from gyre.launch.task import het_group_sizes
from gyre.runtime.preflight import Where


def check_allocation(spec: JobSpec, env: Mapping[str, str]) -> None:
    """`ConfigError` unless the het job's components hold the tasks `spec` asks for."""
    sizes = het_group_sizes(env)
    wanted = [c.ntasks for c in spec.components]
    if sizes is None:
        raise ConfigError(
            "not inside a heterogeneous Slurm job (no SLURM_NTASKS_HET_GROUP_0); submit the "
            "script with sbatch"
        )
    if sizes != wanted:
        raise ConfigError(
            f"the allocation has tasks per het component {sizes} but {spec.launch.path} needs "
            f"{wanted} (coordinator, proxy, {spec.launch.topology.cells} cells"
            f"{', standalone pool' if spec.launch.topology.standalone_engines else ''}); render "
            f"a script for this config: gyre render {spec.launch.path} -o job.sbatch"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.launch.check", description=__doc__)
    parser.add_argument("config")
    args = parser.parse_args(argv)
    return exit_status("gyre", lambda: check(args.config))


def check(config: str) -> int:
    """0 if the allocation this runs in matches `config` and the job can run it here (the
    preflight, on this node, of the run directory `GYRE_RUN_DIR` too); `ConfigError`
    otherwise."""
    run_dir = os.environ.get("GYRE_RUN_DIR")
    spec = job_spec(load_launch(config, where=Where.JOB,
                                run_dir=Path(run_dir) if run_dir else None))  # fmt: skip
    check_allocation(spec, os.environ)
    print(f"[gyre] allocation matches {config}: {spec.world_size} ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
