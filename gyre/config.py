"""Strict loading of typed config dataclasses from YAML / dicts.

Each component owns a `@dataclass(kw_only=True, slots=True) class Config` whose fields carry
a one-line docstring (as a comment) and whose `__post_init__` validates values. This module
turns nested dicts into those dataclasses and rejects unknown keys and wrong types with a
`ConfigError` that names the key path, the value and what is allowed:

    cfg = load(MyConfig, yaml.safe_load(text), path="sim")

Supported field types: bool, int, float, str, Optional[...], list[...], tuple[...],
dict[str, ...], Literal[...], enums and nested dataclasses.

Validation in `__post_init__` raises `ConfigError("field: value ... ; allowed ...")`, its
message starting with the field name; `load` prefixes the key path.

Command-line overrides (`gyre run CONFIG train.lr=3e-4 schedule.policy=async`) are applied
to the raw mapping before `load`, so a mistyped key fails in the same strict loader:

    data = apply_overrides(read_mapping("templates/local.yaml"), ["train.lr=3e-4"])
    cfg = load(RunConfig, data, path="run")
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from gyre.errors import ConfigError

T = TypeVar("T")


def load(cls: type[T], data: Any, path: str = "") -> T:
    """Build `cls` (a dataclass) from `data`, rejecting unknown keys and bad types."""
    return typing.cast(T, _convert(cls, data, path or cls.__name__))


def load_yaml(cls: type[T], file: str | Path, section: str | None = None) -> T:
    """Read a YAML file (optionally one top-level section of it) into `cls`."""
    p = Path(file)
    data: Any = read_mapping(p)
    if section is not None:
        data = data.get(section, {})
    return load(cls, data, path=section or p.stem)


def read_mapping(file: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a non-empty mapping, or a ConfigError (an empty file
    is a mistake, not "all defaults": a run would start a whole default job from it)."""
    import yaml

    p = Path(file)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(p)!r} is a directory; allowed: a YAML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if data is None or data == {}:
        raise ConfigError(f"config file {str(p)!r} is empty; allowed: a YAML mapping of "
                          "sections (templates/ holds complete examples)")  # fmt: skip
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return data


@functools.cache
def _override_loader() -> type:
    """YAML for override values with YAML 1.2 numbers: `3e-4` is a float (YAML 1.1 reads a
    string) and `2:00:00` a string (YAML 1.1 reads the base-60 integer 7200). Built on first
    use, so a process that only `load`s (a harness reading its tool latency) never imports
    YAML."""
    import yaml

    class OverrideLoader(yaml.SafeLoader):
        pass

    int_tag, float_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
    OverrideLoader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (int_tag, float_tag)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    OverrideLoader.add_implicit_resolver(
        int_tag, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
    )
    OverrideLoader.add_implicit_resolver(
        float_tag,
        re.compile(
            r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
            r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF))|\.(?:nan|NaN|NAN))$"
        ),
        list("-+0123456789."),
    )
    return OverrideLoader


def parse_override(text: str) -> tuple[list[str], Any]:
    """`KEY.PATH=VALUE` -> (["KEY", "PATH"], VALUE parsed as YAML); ConfigError if malformed."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE (e.g. train.lr=3e-4)")
    import yaml

    try:
        value = yaml.load(raw, Loader=_override_loader())  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({e})") from None
    return [p.strip() for p in parts], value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `KEY.PATH=VALUE` set, in order (later ones win).

    Missing intermediate mappings are created; unknown keys are left for `load` to refuse
    (naming the key path and the allowed keys). Only a path through a non-mapping value
    (e.g. `steps.x=1`) is refused here.
    """
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # absent, or an empty section (`train:`): start a mapping
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"override {text!r}: {where} is {child!r}, not a mapping with keys"
                )
            node = child
        node[parts[-1]] = value
    return out


def to_dict(obj: Any) -> Any:
    """The inverse of `load`: plain dicts/lists suitable for YAML or JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _allowed(tp: Any) -> str:
    """What a value of type `tp` may be, in the words of a one-line config error."""
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    words = {bool: "true / false", int: "an integer", float: "a number", str: "a string"}
    if tp in words:
        return words[tp]
    return "a list" if typing.get_origin(tp) in (list, tuple) else _type_name(tp)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # `X | None`: X's own error says what is wrong
            return _convert(options[0], value, path)
        for arg in options:
            with contextlib.suppress(ConfigError):
                return _convert(arg, value, path)
        allowed = " or ".join(_allowed(arg) for arg in args)
        raise ConfigError(f"{path}: {value!r}; allowed: {allowed}")
    if origin is typing.Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {allowed}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(
                f"{path}: {value!r} is not allowed; choose one of {allowed}"
            ) from None
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))
            )
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        vt = args[1] if args else Any
        return {str(k): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {_type_name(tp)}")


def _convert_dataclass(cls: Any, value: Any, path: str) -> Any:
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields))
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; allowed keys: {allowed}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}.{name}: required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ messages start with the field name ("phi: ..."), or with the
        # section's own name ("engine.bucket_mb: ..."); add the path, once
        parent, _, own = path.rpartition(".")
        where = parent if str(e).startswith(f"{own}.") and parent else path
        raise ConfigError(f"{where}.{e}") from None
