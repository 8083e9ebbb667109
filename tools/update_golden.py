"""Regenerate the golden sbatch scripts that tests/launch/test_render.py compares against.

    python tools/update_golden.py          # rewrite the files whose rendering changed
    python tools/update_golden.py --check  # only list them; exit status 1 if any differ

The test only reads golden files, so a change to `gyre.launch` or to a template fails it
until someone regenerates them on purpose with this command and reviews `git diff`. The test
imports `GOLDEN` and `render` from here: the files are checked against exactly the rendering
that writes them. `slurm/gyre.sbatch` (the embedded config as a Slurm job) is one of them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.launch.render import RenderOptions, render_script  # noqa: E402
from gyre.launch.spec import job_spec, load_launch  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "launch" / "golden"
TEMPLATES = tuple(sorted(p.stem for p in (ROOT / "templates" / "cluster").glob("*.yaml")))


@dataclasses.dataclass(frozen=True, slots=True)
class Golden:
    """One golden file and the rendering it must equal."""

    config: str
    """The run config, as a user types it from the repository root."""
    script: str
    """The script's name in its own usage comment."""
    path: Path
    """The golden file."""


GOLDEN: tuple[Golden, ...] = (
    *(Golden(f"templates/cluster/{n}.yaml", f"{n}.sbatch", GOLDEN_DIR / f"{n}.sbatch")
      for n in TEMPLATES),
    Golden("templates/local.yaml", "slurm/gyre.sbatch", ROOT / "slurm" / "gyre.sbatch"),
)  # fmt: skip


def render(golden: Golden) -> str:
    """The script text for `golden`'s config, rendered from the repository root (so the
    paths in it are the ones a user types there, the same on every machine)."""
    with contextlib.chdir(ROOT):
        return render_script(job_spec(load_launch(golden.config)),
                             RenderOptions(script=golden.script))  # fmt: skip


def update(goldens: Sequence[Golden], *, write: bool = True) -> list[Path]:
    """The golden files whose text differs from their rendering (rewritten when `write`)."""
    changed = []
    for golden in goldens:
        text = render(golden)
        if not golden.path.exists() or golden.path.read_text() != text:
            changed.append(golden.path)
            if write:
                golden.path.write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="list stale files, write nothing")
    args = p.parse_args(argv)
    changed = update(GOLDEN, write=not args.check)
    verb = "differs" if args.check else "rewritten"
    for path in changed:
        print(f"{verb}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if not changed:
        print(f"all {len(GOLDEN)} golden files match their rendering")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
