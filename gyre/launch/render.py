"""Render a run config into the sbatch script of its heterogeneous job (`gyre render`).

The script comes from one jinja2 template (templates/hetjob.sbatch.jinja beside this file):
one `#SBATCH hetjob` block per component (spec.py), the job-wide options (name, time,
signal, requeue) on the first, then one `srun --het-group=0-N` step that starts the MPI world.
The same text serves `sbatch` (the task runs `python -m gyre.runtime.main CONFIG --run-dir D`)
and `gyre submit` (the task runs submitit's entry, which calls the same main).

    text = render_script(job_spec(load_launch("templates/local.yaml")))
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from gyre.launch.config import PMI2_ENV
from gyre.launch.spec import JobSpec, Request
from gyre.launch.task import EXIT_CHECKPOINTED

TEMPLATE = Path(__file__).parent / "templates" / "hetjob.sbatch.jinja"
ENTRY = "gyre.runtime.main"


@dataclass(kw_only=True, slots=True)
class RenderOptions:
    """How the task command line and paths appear in the script."""

    config: str | None = None
    """Config path written into the script (default: the path the config was loaded from)."""
    script: str = "gyre.sbatch"
    """How the script is named in its own usage comment."""
    entry: str = ENTRY
    """Default module every task runs with `python -m` (batch mode; `$GYRE_ENTRY` overrides)."""
    command: str | None = None
    """Replace the whole task command (submitit mode)."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun words beyond the config's, inserted verbatim (already shell-quoted)."""
    output: str | None = None
    """The batch script's own log (`--output`); default `<slurm.log_dir>/%x-%j.out`."""
    exports: dict[str, str] = field(default_factory=dict)
    """Extra variables exported before the step (submitit needs SUBMITIT_EXECUTOR)."""


def render_script(spec: JobSpec, options: RenderOptions | None = None) -> str:
    """The sbatch script text for `spec`."""
    opts = options or RenderOptions()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    return env.get_template(TEMPLATE.name).render(**_context(spec, opts))


def _context(spec: JobSpec, opts: RenderOptions) -> dict[str, Any]:
    s = spec.launch.slurm
    config = opts.config or str(spec.launch.path)
    runs_dir = spec.launch.runs_dir
    plugin_env = PMI2_ENV if s.mpi == "pmi2" else {}
    command = opts.command or (
        f'{s.python} -u -m "${{GYRE_ENTRY:-{opts.entry}}}" "$GYRE_CONFIG" --run-dir "$GYRE_RUN_DIR"'
        ' ${GYRE_STEPS:+--steps "$GYRE_STEPS"}'
    )
    first_rank = 0
    components = []
    for c in spec.components:
        last = first_rank + c.ntasks - 1
        ranks = str(first_rank) if last == first_rank else f"{first_rank}-{last}"
        components.append(
            {
                "label": _label(c),
                "nodes": c.nodes,
                "ntasks": c.ntasks,
                "ranks": ranks,
                "lines": _component_lines(c, spec),
            }
        )
        first_rank = last + 1
    return {
        "config": config,
        "script": opts.script,
        "name": spec.launch.name,
        "runs_dir": runs_dir,
        "components": components,
        "job_name": s.job_name,
        "output": opts.output or f"{s.log_dir.rstrip('/') or '/'}/%x-%j.out",
        "signal": f"B:USR1@{s.signal_seconds}" if s.signal_seconds else "",
        "requeue": s.requeue,
        "extra_sbatch": s.extra_sbatch,
        "setup": s.setup,
        "env": [
            (k, shlex.quote(v)) for k, v in sorted({**plugin_env, **s.env, **opts.exports}.items())
        ],
        "pmi2_netmod": bool(plugin_env.keys() - s.env.keys()),
        "python": s.python,
        "exit_checkpointed": EXIT_CHECKPOINTED,
        "het_groups": spec.het_groups,
        "mpi": s.mpi,
        "srun_args": [*(shlex.quote(a) for a in s.srun_args), *opts.srun_args],
        "command": command,
    }


def _label(c: Request) -> str:
    if c.role == "cell":
        return f"cell {c.index} ({'core' if c.index == 0 else 'satellite'})"
    if c.role == "standalone":
        return "standalone pool"
    return c.role


def _component_lines(c: Request, spec: JobSpec) -> list[str]:
    s = spec.launch.slurm
    lines = []
    if c.partition:
        lines.append(f"--partition={c.partition}")
    if s.account:
        lines.append(f"--account={s.account}")
    if s.qos:
        lines.append(f"--qos={s.qos}")
    lines.append(f"--time={s.time_limit}")
    lines.append(f"--nodes={c.nodes}")
    lines.append(f"--ntasks={c.ntasks}")
    if c.nodes > 1:
        lines.append(f"--ntasks-per-node={c.ntasks_per_node}")
    lines.append(f"--cpus-per-task={c.cpus_per_task}")
    if c.gpus_per_node:
        lines.append(f"--gpus-per-node={c.gpus_per_node}")
    if c.mem is not None:
        lines.append(f"--mem={c.mem}")
    if c.constraint:
        lines.append(f"--constraint={c.constraint}")
    if s.exclusive:
        lines.append("--exclusive")
    return lines
