"""`gyre render CONFIG` and `gyre submit CONFIG`: Gyre's heterogeneous Slurm job.

    gyre render templates/cluster/paper-32.yaml -o job.sbatch && sbatch job.sbatch
    gyre render templates/local.yaml --check          # also check the partitions (sinfo)
    gyre submit templates/local.yaml                  # through submitit; follows the job
    gyre render templates/cluster/nl2repo-32.yaml topology.cells=4 slurm.time_limit=2:00:00

Both validate the whole run config first; `submit` (and `render --check`) also check it
against the cluster's partitions, so a job the cluster cannot run is never submitted.
`KEY.PATH=VALUE` overrides follow CONFIG; the merged config is written under
`<runs_dir>/configs/` and the job's tasks read that file.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path
from typing import Any

from gyre import cliargs

OVERRIDES_HELP = "set config keys (after CONFIG, also after options), e.g. train.lr=3e-4"


def register(sub: Any) -> None:
    p = sub.add_parser("render", help="print the sbatch script of a run config")
    p.add_argument("config", help="run YAML (templates/local.yaml, templates/cluster/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help=OVERRIDES_HELP)
    p.add_argument(
        "-o", "--output", type=cliargs.output_file, help="write the script here instead of stdout"
    )
    p.add_argument("--check", action="store_true", help="check against the cluster (sinfo)")
    p.set_defaults(func=render_main)

    s = sub.add_parser("submit", help="submit a run as a heterogeneous job through submitit")
    s.add_argument("config", help="run YAML")
    s.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help=OVERRIDES_HELP)
    s.add_argument("--folder", help="submitit folder (default: <runs_dir>/submitit)")
    s.add_argument("--steps", type=cliargs.count, default=None, help="override the config's steps")
    s.add_argument("--entry", default=None, help="task module (default gyre.runtime.main)")
    s.add_argument("--no-check", action="store_true", help="skip the cluster check")
    s.add_argument("--no-follow", action="store_true", help="print the job id and return")
    s.add_argument(
        "--timeout", type=cliargs.positive_float, default=None, help="give up following after S s"
    )
    s.set_defaults(func=submit_main)


def render_main(args: argparse.Namespace) -> int:
    from gyre.launch.render import RenderOptions, render_script
    from gyre.launch.spec import job_spec, load_launch
    from gyre.runtime.preflight import Where

    where = Where.CLUSTER if args.check else Where.ANYWHERE
    spec = job_spec(load_launch(args.config, args.overrides, where))
    if args.check:
        from gyre.launch.cluster import query_cluster, validate

        validate(spec, query_cluster())
    for line in spec.footprint():
        print(f"gyre render: {line}", file=sys.stderr)
    text = render_script(spec, RenderOptions(script=args.output or "gyre.sbatch"))
    if args.output:
        out = Path(args.output)
        out.write_text(text)
        mode = out.stat().st_mode
        if stat.S_ISREG(mode):  # executable where readable; never a device (-o /dev/null)
            out.chmod(mode | (mode & 0o444) >> 2)
    else:
        print(text, end="")
    return 0


def submit_main(args: argparse.Namespace) -> int:
    from gyre.launch.render import ENTRY
    from gyre.launch.spec import job_spec, load_launch
    from gyre.launch.submit import follow, submit
    from gyre.runtime.preflight import Where

    where = Where.ANYWHERE if args.no_check else Where.CLUSTER
    launch = load_launch(args.config, args.overrides, where)
    if not args.no_check:
        from gyre.launch.cluster import query_cluster, validate

        validate(job_spec(launch), query_cluster())
    for note in launch.warnings:
        print(f"gyre submit: warning: {note}", file=sys.stderr)
    folder = Path(args.folder or Path(launch.runs_dir) / "submitit")
    job = submit(launch, folder, entry=args.entry or ENTRY, steps=args.steps)
    print(f"[gyre] submitted job {job.job_id} ({folder}/{job.job_id}_submission.sh)", flush=True)
    if args.no_follow:
        return 0
    result = follow(job, timeout_s=args.timeout)
    print(json.dumps(result, indent=1, default=str))
    return 0
