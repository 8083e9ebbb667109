"""Harness adapters: a command template plus environment, per black-box harness.

An adapter is configuration, not code: which API the harness speaks (OpenAI or Anthropic),
the argv to run (with `{placeholders}`), extra environment, default parameters and where
to look for the binary. Built-in adapters live in `adapters.yaml` beside this file; a run's
config may add its own entries with the same keys.

Placeholders filled per execution: `{python}` (this interpreter), `{instruction}`,
`{instruction_file}`, `{feedback_file}`, `{workspace}`, `{model}`, `{execution_id}`, plus every key of the
adapter's `params` (overridable per run). An unknown placeholder is a `ConfigError`.

Every param declares its type in `param_types` (an adapter loaded from YAML must; one built in
code defaults to `str`): `int` (an integer >= 0), `float` (a number >= 0), `str`, or the
allowed words `a|b|c`. `check_params` refuses an unknown param or a value of the wrong type in
one line; the preflight (`gyre.runtime.preflight`) and the runner, per execution, call it, so
`harness.params.max_turns=lots` is refused before any process starts instead of every harness
exiting 2.

`sandbox_binds` name the folders a harness's program needs inside the sandbox (its
node_modules, its virtual environment), read-only; `gyre.harness.sandbox` adds them to the
allow-list.

`role_rules` label the harness's own model calls for the proxy (`gyre.vocabulary.RoleRule`:
role, source, pattern; first match wins): a black-box harness sends no `x-gyre-role`
header, so its compaction and sub-agent calls are told apart by what the request says.
The runtime gives the proxy a run's `proxy.role_rules` first, then the adapter's.
"""

from __future__ import annotations

import os
import shutil
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from gyre.config import load
from gyre.errors import ConfigError
from gyre.vocabulary import RoleRule

ADAPTERS_FILE = Path(__file__).with_name("adapters.yaml")
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_PLACEHOLDERS = (
    "python",
    "instruction",
    "instruction_file",
    "feedback_file",
    "workspace",
    "model",
    "execution_id",
)


@dataclass(kw_only=True, slots=True)
class Adapter:
    """How to run one kind of harness against the proxy."""

    # adapter name (the key in adapters.yaml)
    name: str = ""
    # API the harness speaks: openai (OPENAI_BASE_URL/OPENAI_API_KEY) or anthropic
    api: Literal["openai", "anthropic"]
    # argv template; element 0 is the program (looked up on PATH and search_path)
    command: list[str]
    # extra environment for the harness (values may use placeholders)
    env: dict[str, str] = field(default_factory=dict)
    # default values of adapter-specific placeholders
    params: dict[str, str] = field(default_factory=dict)
    # each param's type: int (>= 0), float (>= 0), str, or allowed words "a|b|c"
    param_types: dict[str, str] = field(default_factory=dict)
    # extra directories searched for the program, relative to the repository root or absolute
    search_path: list[str] = field(default_factory=list)
    # folders the program needs inside the sandbox, read-only (its node_modules or virtual
    # environment; gyre/harness/sandbox.py); relative to the repository root or absolute
    sandbox_binds: list[str] = field(default_factory=list)
    # how to install the harness (shown when the program is not found)
    install: str = ""
    # whether the harness applies the task's tool-latency knob (GYRE_TOOL_LATENCY)
    applies_tool_latency: bool = False
    # labels of the harness's calls by request text (compaction, subagent); first match wins
    role_rules: list[RoleRule] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("command: must name a program")
        allowed = set(BUILTIN_PLACEHOLDERS) | set(self.params)
        for text in [*self.command, *self.env.values()]:
            for _, name, _, _ in string.Formatter().parse(text):
                if name is not None and name not in allowed:
                    raise ConfigError(
                        f"command: unknown placeholder {{{name}}} in {text!r}; "
                        f"allowed: {', '.join(sorted(allowed))}"
                    )
        for name, kind in self.param_types.items():
            if name not in self.params:
                raise ConfigError(f"param_types: {name!r} is not a param; allowed: "
                                  f"{', '.join(sorted(self.params)) or '(none)'}")  # fmt: skip
            if not _kind_ok(kind):
                raise ConfigError(f"param_types.{name}: {kind!r}; allowed: {', '.join(PARAM_TYPES)} "
                                  "or the allowed words a|b|c")  # fmt: skip
        self.check_params(self.params)  # the defaults have their declared types

    def render(
        self, values: dict[str, str], overrides: dict[str, str] | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """(argv, env) with placeholders filled; overrides replace `params` defaults."""
        self.check_params(overrides or {})
        fill = {**self.params, **(overrides or {}), **values}
        argv = [part.format(**fill) for part in self.command]
        env = {k: v.format(**fill) for k, v in self.env.items()}
        return argv, env

    def check_params(self, overrides: dict[str, str]) -> None:
        """Raise ConfigError naming the first parameter this adapter does not declare, or
        whose value is not of its declared type."""
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            raise ConfigError(
                f"params: unknown parameter {unknown[0]!r} for adapter {self.name!r}; "
                f"allowed: {', '.join(sorted(self.params)) or '(none)'}"
            )
        for name, value in overrides.items():
            kind = self.param_types.get(name, "str")
            if not _value_ok(kind, value):
                raise ConfigError(f"params.{name}: {value!r}; allowed: {_describe(kind)} "
                                  f"(adapter {self.name!r})")  # fmt: skip

    def sandbox_paths(self) -> list[Path]:
        """`sandbox_binds` as absolute paths (the relative ones under the repository root)."""
        return [Path(d) if Path(d).is_absolute() else REPO_ROOT / d for d in self.sandbox_binds]

    def resolve_program(self, path_env: str) -> str | None:
        """Absolute path of the program, or None when it is not installed."""
        program = self.command[0].format(python=sys.executable)
        if os.sep in program:
            return program if os.access(program, os.X_OK) else None
        dirs = [str(d if Path(d).is_absolute() else REPO_ROOT / d) for d in self.search_path]
        return shutil.which(program, path=os.pathsep.join([path_env, *dirs]))


PARAM_TYPES = ("int", "float", "str")
"""Types a param may declare, besides allowed words `a|b|c`."""


def _kind_ok(kind: str) -> bool:
    return kind in PARAM_TYPES or (
        "|" in kind and all(w and not w.isspace() for w in kind.split("|"))
    )


def _value_ok(kind: str, value: str) -> bool:
    if kind == "int":
        return value.isascii() and value.isdigit()
    if kind == "float":
        try:
            number = float(value)
        except ValueError:
            return False
        return 0 <= number < float("inf")
    if "|" in kind:
        return value in kind.split("|")
    return True


def _describe(kind: str) -> str:
    if kind == "int":
        return "an integer >= 0"
    if kind == "float":
        return "a number >= 0"
    if "|" in kind:
        return "one of " + ", ".join(kind.split("|"))
    return "a string"


def builtin_adapters() -> dict[str, Adapter]:
    """The adapters shipped in adapters.yaml, by name."""
    return load_adapters(yaml.safe_load(ADAPTERS_FILE.read_text()), path="adapters.yaml")


def load_adapters(data: object, path: str = "adapters") -> dict[str, Adapter]:
    """Adapters from a mapping name -> adapter fields (as in adapters.yaml)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of adapter name -> settings")
    out = {}
    for name, entry in data.items():
        if isinstance(entry, dict):
            entry = {**entry, "name": str(name)}
        adapter = out[str(name)] = load(Adapter, entry, path=f"{path}.{name}")
        untyped = sorted(set(adapter.params) - set(adapter.param_types))
        if untyped:
            raise ConfigError(f"{path}.{name}.param_types: no type for param {untyped[0]!r}; "
                              f"allowed: {', '.join(PARAM_TYPES)} or the allowed words a|b|c")  # fmt: skip
    return out


def get_adapter(name: str) -> Adapter:
    adapters = builtin_adapters()
    if name not in adapters:
        raise ConfigError(f"adapter: {name!r} is not known; allowed: {', '.join(sorted(adapters))}")
    return adapters[name]
