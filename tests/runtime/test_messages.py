"""Every inter-process message is a type with one handler, and the docs' table is the types'."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from gyre.runtime import messages as msg
from gyre.runtime.cell import CellProcess
from gyre.runtime.coordinator import MESSAGES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def test_docs_message_table_is_generated_from_the_types() -> None:
    text = DOCS.read_text()
    block = re.search(r"<!-- messages:begin -->\n(.*?)\n<!-- messages:end -->", text, re.S)
    assert block is not None, "docs/runtime.md lost its messages markers"
    assert block.group(1) == msg.table(), "regenerate with gyre.runtime.messages.table()"
    documented = set(re.findall(r"^\| `(\w+)` \|", block.group(1), re.M))
    assert documented == {cls.__name__ for cls in msg.ALL}


def _sample(cls: type[msg.Message]) -> msg.Message:
    kinds = {"int": 1, "str": "e1", "float": 0.5, "bool": True}
    return cls(**{f.name: kinds.get(str(f.type).split(" ")[0]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", msg.ALL, ids=lambda c: c.__name__)
def test_every_message_survives_the_wire_and_has_a_handler(cls: type[msg.Message]) -> None:
    m = _sample(cls)
    assert pickle.loads(pickle.dumps(m)) == m
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, "x", 1)  # noqa: B010 (frozen: nobody edits a message in flight)
    receiver = cls.route[1]
    if cls.up:
        startup = {msg.ProxyReady, msg.EngineReady}
        assert cls in MESSAGES or cls in startup, f"the coordinator ignores {cls.__name__}"
        assert receiver == msg.COORDINATOR
    elif receiver == msg.CELL:
        assert cls in _cell_handlers(), f"cells ignore {cls.__name__}"
    elif cls is not msg.Stop:
        from gyre.runtime.proxy_node import ProxyNode

        assert f"msg.{cls.__name__}: self." in _source(ProxyNode.serve), cls.__name__


def _cell_handlers() -> set[type]:
    cell = CellProcess.__new__(CellProcess)
    CellProcess.__init__(cell, _config(), engine_index=0, comms=None, run_dir=Path("."),
                         engine=None)  # type: ignore[arg-type]  # fmt: skip
    return set(cell.handlers)


def _config() -> Any:
    from gyre.runtime.cli import DEFAULT_CONFIG
    from gyre.runtime.config import load_run_config

    return load_run_config(DEFAULT_CONFIG)


def _source(fn: Any) -> str:
    import inspect

    return inspect.getsource(fn)
