"""Package namespaces that import a submodule only when one of its names is first used.

A harness process (`python -m gyre.harness.reference_agent`, hundreds per run) needs two
small modules of `gyre.harness`; the package's namespace (the runner, asyncio, the adapters,
the evaluator) is for the runtime. With

    __getattr__, __dir__ = lazy_exports(globals(), {"HarnessRunner": "gyre.harness.runner"})

`from gyre.harness import HarnessRunner` imports `gyre.harness.runner` at that moment
(PEP 562) and keeps the name; type checkers read the `if TYPE_CHECKING:` imports beside it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], names: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for the package whose globals are `namespace`: each name
    of `names` comes from the module it maps to."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
