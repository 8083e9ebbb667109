"""A run's product: its policies as Hugging Face model directories.

Every publication the core makes is written to `RUN_DIR/policies/v<version>/` and the end
of a run writes `RUN_DIR/policies/final/`: `config.json`, the weights, the tokenizer with
its chat template, `gyre-policy.json` (version, run) and a model card (`README.md`: base
model, updates, how to load and evaluate). The weights are written by the ranks that hold
them (`save_parts`, collective over the core cell): each sender of `Replica.part` — a torch
cell's leader, a Megatron cell's stage senders — writes its part as a safetensors file of
its own (`model.safetensors` for one sender, else `model-0000k-of-0000P.safetensors` and the
leader's `model.safetensors.index.json`), so no rank gathers the whole model to save it.
Directories and files are
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

import copy
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre import fsafe
from gyre.train.comm import Alone

POLICIES = "policies"
META = "gyre-policy.json"
MADE_BY = "gyre policy"  # the marker of a policy directory (gyre.fsafe)
WRITTEN = (META, "README.md", "config.json")  # what every policy directory Gyre wrote holds
INDEX = "model.safetensors.index.json"
Named = Sequence[tuple[str, Any]]


def policy_dir(run_dir: Path, name: str) -> Path:
    return run_dir / POLICIES / name


def version_name(version: int) -> str:
    return f"v{version:05d}"


def save_policy(
    run_dir: Path, name: str, model: Any, tokenizer: Any, *, version: int, keep: int | None = None
) -> Path:
    """Write the whole `model` (held by this one process) + `tokenizer` as policy `name`;
    prune publications beyond `keep` (`save_parts` with one sender)."""
    state = model.state_dict()  # its parameters (tied ones once) and persistent buffers
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in state)]
    path = save_parts(Alone(), named, run_dir, name, config=model.config, tokenizer=tokenizer,
                      generation=getattr(model, "generation_config", None), version=version,
                      keep=keep)  # fmt: skip
    assert path is not None
    return path


def save_parts(
    comm: Any, part: Named | None, run_dir: Path, name: str, *, version: int,
    config: Any = None, tokenizer: Any = None, generation: Any = None, keep: int | None = None,
) -> Path | None:  # fmt: skip
    """Collective over `comm` (a cell's communicator, rank 0 its leader, which alone passes
    `config`, `tokenizer` and optionally `generation`, the transformers objects): write
    policy `name` from the ranks that hold the weights, each rank with a `part` its own
    safetensors file, into the directory the leader made beside the final name; the leader
    then writes the index, config, tokenizer, meta and model card, renames the directory
    into place and prunes publications beyond `keep`. The leader returns the path, the
    others None."""
    leader = comm.Get_rank() == 0
    root = run_dir / POLICIES
    tmp = None
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        tmp = fsafe.make_temp_dir(f".{name}-", root)
    folder = Path(comm.bcast(None if tmp is None else str(tmp), root=0))
    senders = [r for r, sends in enumerate(comm.allgather(part is not None)) if sends]
    written: dict[str, Any] | OSError | None = None
    if part is not None:
        try:  # the others wait in the gather: every rank hears of a failed write
            written = _write_part(folder, part, senders.index(comm.Get_rank()), len(senders))
        except OSError as e:
            written = e
    parts = comm.gather(written, root=0)
    if not leader:
        if isinstance(written, OSError):
            raise written
        return None
    final = root / name
    try:  # a policy written in part is not left behind (the leader made its directory)
        failed = [p for p in parts if isinstance(p, OSError)]
        if failed:
            raise failed[0]
        _write_head(folder, [p for p in parts if p is not None], config, tokenizer, generation)
        (folder / META).write_text(json.dumps({"version": version, "run": run_dir.name,
                                               "name": name}))  # fmt: skip
        (folder / "README.md").write_text(model_card(run_dir, name, version))
        fsafe.adopt(final, MADE_BY, WRITTEN)  # an older Gyre's, written before markers
        fsafe.move_into_place(folder, final, MADE_BY)  # readable as the umask allows
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if keep is not None:
        prune(run_dir, keep)
    return final


def weights_file(k: int, files: int) -> str:
    """The name of the k-th (from 0) of a policy's `files` safetensors files, as
    transformers names a sharded model's."""
    return "model.safetensors" if files == 1 else f"model-{k + 1:05d}-of-{files:05d}.safetensors"


def _write_part(folder: Path, part: Named, k: int, files: int) -> dict[str, Any]:
    """One sender's tensors as weights file k of `files`: (its name, each tensor's bytes,
    their dtype)."""
    from safetensors.torch import save_file

    from gyre.rollout.weights import checkpoint_names

    # as a checkpoint names them (a MoE layer's experts one tensor each), host copies: a
    # part's tensors may be views of one flat buffer, or on a GPU
    tensors = {n: t.detach().to("cpu", copy=True).contiguous()
               for n, t in checkpoint_names(list(part))}  # fmt: skip
    file = weights_file(k, files)
    save_file(tensors, str(folder / file), metadata={"format": "pt"})
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return {"file": file, "bytes": {n: t.numel() * t.element_size() for n, t in tensors.items()},
            "dtype": str(min(dtypes, key=str)).removeprefix("torch.") if dtypes else None}  # fmt: skip


def _write_head(folder: Path, parts: list[dict[str, Any]], config: Any, tokenizer: Any,
                generation: Any) -> None:  # fmt: skip
    """The leader's share of a policy directory: the index of several weights files, the
    config (saying the weights' dtype), the generation config and the tokenizer."""
    if len(parts) > 1:
        weight_map = {n: p["file"] for p in parts for n in p["bytes"]}
        total = sum(b for p in parts for b in p["bytes"].values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = copy.deepcopy(config)
    dtype = next((p["dtype"] for p in parts if p["dtype"] is not None), None)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(folder)
    if generation is not None:
        generation.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _portable_tokenizer(folder)


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
