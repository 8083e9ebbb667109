"""The strict config loader: unknown keys and bad values name the key path and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from gyre.config import load, to_dict
from gyre.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class Inner:
    concurrency: int = 4
    mode: Literal["a", "b"] = "a"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"concurrency: {self.concurrency} is not allowed; must be >= 1")


@dataclass(kw_only=True, slots=True)
class Outer:
    name: str
    ratio: float = 0.5
    cells: list[Inner] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)
    maybe: int | None = None


def test_round_trip() -> None:
    data = {"name": "x", "ratio": 1, "cells": [{"concurrency": 2, "mode": "b"}], "extra": {"k": 3}}
    cfg = load(Outer, data)
    assert cfg.ratio == 1.0 and isinstance(cfg.ratio, float)
    assert cfg.cells[0].mode == "b"
    assert to_dict(cfg) == {**data, "ratio": 1.0, "maybe": None}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "colls": []}, "cfg: unknown key 'colls'; allowed keys: cells, extra"),
        ({}, "cfg.name: required key is missing"),
        ({"name": 3}, "cfg.name: expected a string, got 3"),
        ({"name": "x", "ratio": "high"}, "cfg.ratio: expected a number, got 'high'"),
        (
            {"name": "x", "cells": [{"concurrency": 0}]},
            "cfg.cells[0].concurrency: 0 is not allowed",
        ),
        (
            {"name": "x", "cells": [{"mode": "c"}]},
            "cfg.cells[0].mode: 'c' is not allowed; choose one of 'a', 'b'",
        ),
        ({"name": "x", "cells": [{"concurrency": True}]}, "expected an integer, got True"),
        ({"name": "x", "maybe": "1"}, "cfg.maybe: expected an integer, got '1'"),
    ],
)
def test_bad_values_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load(Outer, data, path="cfg")
    assert message in str(err.value)
