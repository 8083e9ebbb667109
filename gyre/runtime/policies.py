"""A run's product: its policies as Hugging Face model directories.

Every publication the core makes is written to `RUN_DIR/policies/v<version>/` and the end
of a run writes `RUN_DIR/policies/final/`: `config.json`, `model.safetensors`, the
tokenizer with its chat template, and `gyre-policy.json` (version, run). A directory is
written beside its final name and renamed into place, so a reader never sees half of one;
only the newest `train.keep_policies` publications are kept (`final` always is).

    AutoModelForCausalLM.from_pretrained("runs/x/policies/final")   # any transformers user
    gyre engine --model runs/x/policies/final                       # served by Gyre
    gyre eval runs/x                                                # held-out evaluation

A restarted engine loads the newest publication (`latest`), so it serves what the others do.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

POLICIES = "policies"
META = "gyre-policy.json"


def policy_dir(run_dir: Path, name: str) -> Path:
    return run_dir / POLICIES / name


def version_name(version: int) -> str:
    return f"v{version:05d}"


def save_policy(
    run_dir: Path, name: str, model: Any, tokenizer: Any, *, version: int, keep: int | None = None
) -> Path:
    """Write `model` + `tokenizer` as policy `name`; prune publications beyond `keep`."""
    root = run_dir / POLICIES
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    # the replica's parameters are views of one flat buffer: save copies, not the views
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / META).write_text(json.dumps({"version": version, "run": run_dir.name, "name": name}))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if keep is not None:
        prune(run_dir, keep)
    return final


def published(run_dir: Path) -> list[tuple[int, Path]]:
    """(version, directory) of the kept publications, oldest first."""
    root = run_dir / POLICIES
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        if d.name.startswith("v") and d.name[1:].isdigit() and (d / META).exists():
            out.append((int(d.name[1:]), d))
    return sorted(out)


def latest(run_dir: Path) -> tuple[int, Path] | None:
    """The newest publication, or None before the first one."""
    kept = published(run_dir)
    return kept[-1] if kept else None


def prune(run_dir: Path, keep: int) -> None:
    for _, d in published(run_dir)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def load_weights(path: Path) -> list[tuple[str, Any]]:
    """The named tensors of a policy directory (safetensors), in file order."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    named: list[tuple[str, Any]] = []
    for f in files:
        named += list(load_file(str(f)).items())
    return named


def policy_version(path: Path) -> int:
    """The policy version recorded in a policy directory."""
    return int(json.loads((path / META).read_text())["version"])
