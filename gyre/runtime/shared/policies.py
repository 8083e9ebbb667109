"""A run's product: its policies as Hugging Face model directories.

Every publication the core makes is written to `RUN_DIR/policies/v<version>/` and the end
of a run writes `RUN_DIR/policies/final/`: `config.json`, `model.safetensors`, the
tokenizer with its chat template, `gyre-policy.json` (version, run) and a model card
(`README.md`: base model, updates, how to load and evaluate). Directories and files are
readable as the umask allows (a group on a shared file system), and the tokenizer loads under
transformers 4.57 as well as 5. A directory is
written beside its final name and renamed into place, so a reader never sees half of one;
only the newest `train.keep_policies` publications are kept (`final` always is). Only a
policy directory Gyre wrote (its `.gyre-owned` marker, `gyre.fsafe`) is ever replaced or
pruned.

    AutoModelForCausalLM.from_pretrained("runs/x/policies/final")   # any transformers user
    gyre engine --model runs/x/policies/final                       # served by Gyre
    gyre eval runs/x                                                # held-out evaluation

A restarted engine loads the newest publication (`latest`), so it serves what the others do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre import fsafe

POLICIES = "policies"
META = "gyre-policy.json"
MADE_BY = "gyre policy"  # the marker of a policy directory (gyre.fsafe)
WRITTEN = (META, "README.md", "config.json")  # what every policy directory Gyre wrote holds


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
    tmp = fsafe.make_temp_dir(f".{name}-", root)
    # the replica's parameters are views of one flat buffer: save copies, not the views
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _portable_tokenizer(tmp)
    (tmp / META).write_text(json.dumps({"version": version, "run": run_dir.name, "name": name}))
    (tmp / "README.md").write_text(model_card(run_dir, name, version))
    fsafe.adopt(final, MADE_BY, WRITTEN)  # an older Gyre's, written before markers
    fsafe.move_into_place(tmp, final, MADE_BY)  # readable as the umask allows
    if keep is not None:
        prune(run_dir, keep)
    return final


def _portable_tokenizer(folder: Path) -> None:
    """transformers 5 names its generic fast tokenizer `TokenizersBackend`, a class that
    transformers 4.57 (which Gyre allows) does not know; both load the same tokenizer.json
    under the older name `PreTrainedTokenizerFast`."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def model_card(run_dir: Path, name: str, version: int) -> str:
    """The policy's README.md: what it is, where it came from, how to load and evaluate it."""
    from gyre import provenance

    made = provenance()
    base = "(see the run's config.yaml)"
    config = run_dir / "config.yaml"
    if config.exists():
        import yaml

        base = str((yaml.safe_load(config.read_text()) or {}).get("model", base))
    return (
        f"# {run_dir.name} / {name}\n\n"
        f"A policy trained by Gyre {made['gyre_version']} (online RL of an LLM agent through "
        f"its harness): base model `{base}`, after {version} optimizer updates of run "
        f"`{run_dir.name}`.\n\n"
        f"* Gyre commit: `{made['git_commit'] or 'not from a git checkout'}`\n"
        "* run config: `config.yaml` in the run directory; trace: `trace.h5`\n"
        "* held-out evaluation: `gyre eval RUN_DIR` (results in `eval.json`)\n"
        "* load: `AutoModelForCausalLM.from_pretrained(DIR)`; serve: `gyre engine --model DIR`\n"
    )


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
    """Remove the publications before the newest `keep` (one without Gyre's marker stays)."""
    for _, d in published(run_dir)[:-keep]:
        fsafe.adopt(d, MADE_BY, WRITTEN)
        if fsafe.maker_of(d) == MADE_BY:
            fsafe.remove_tree(d, MADE_BY, ignore_errors=True)


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
