"""Gyre's import structure: no module-level import cycle, and no import that climbs a floor.

Every module under gyre/ is parsed with `ast`; every `import` / `from ... import` anywhere in
the file counts (module level, inside functions, under `if TYPE_CHECKING:`), because an
import that only serves annotations still couples the two modules. `from gyre.proxy import
admin` is an edge to the module `gyre.proxy.admin`; `from gyre.proxy import ProxyApp` one
to the package's `__init__`. Relative imports are resolved against the importing package.

Floors, top to bottom (a package may import its own floor's other packages one way only,
and any package on a lower floor):

* entry points: `gyre.cli`, `gyre.__main__`, `gyre.launch` (renders and submits jobs that
  run `gyre.runtime`);
* `gyre.runtime`: the coordinator, proxy node and cells of a job;
* what a job's ranks host: `gyre.proxy`, `gyre.harness`, `gyre.gpu` (the GPU checks drive
  rollout engines and trainer cells, so they sit above both);
* the planes: `gyre.rollout`, `gyre.train`, `gyre.sim`, `gyre.tasks`;
* pure records and logic: `gyre.schedule`, `gyre.trajectory`;
* ground: `gyre.config`, `gyre.errors`, `gyre.vocabulary` (the shared enums and ids),
  `gyre.models`, `gyre.lazy`, `gyre.lifetime`, `gyre.zygote` (processes forked from one that
  has imported what they need), `gyre.tracking`, `gyre.cliargs` (the command
  line's parser class and argument types), `gyre.fsafe` (what may be deleted and written),
  `gyre.cache` (where results kept between runs live) and the root `gyre`.

A new top-level package or module has to be placed on a floor here first.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "gyre"

FLOORS: list[tuple[str, ...]] = [
    ("gyre.cli", "gyre.__main__", "gyre.launch"),
    ("gyre.runtime",),
    ("gyre.proxy", "gyre.harness", "gyre.gpu"),
    ("gyre.rollout", "gyre.train", "gyre.sim", "gyre.tasks"),
    ("gyre.schedule", "gyre.trajectory"),
    ("gyre.config", "gyre.errors", "gyre.vocabulary", "gyre.models", "gyre.lazy",
     "gyre.lifetime", "gyre.zygote", "gyre.tracking", "gyre.cliargs", "gyre.fsafe", "gyre.cache", "gyre"),
]  # fmt: skip
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    line: int
    target: str  # imported module (a package's import lands on its __init__)


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under gyre/ (packages by their name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """Every import of a gyre module in the file, resolved to the module it loads."""

    def nearest(dotted: str) -> str:  # `import gyre.x.Thing` -> gyre.x
        while dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                       for a in node.names]  # fmt: skip
        else:
            continue
        for t in targets:
            if t == "gyre" or t.startswith("gyre."):
                edges.append(Edge(name, node.lineno, nearest(t)))
    return edges


def unit(module: str) -> str:
    """The floor plan's unit of a module: its top-level package or module under gyre."""
    return ".".join(module.split(".")[:2])


@functools.cache
def graph() -> list[Edge]:
    """Every import edge between gyre modules (parsed once per test session)."""
    known = modules()
    return [e for name, path in known.items() for e in imports(name, path, known)]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target:
            succ.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_on_a_floor() -> None:
    unplaced = sorted({unit(m) for m in modules()} - set(FLOOR))
    assert not unplaced, f"place these on a floor in tests/test_layers.py: {unplaced}"


def test_no_import_cycle() -> None:
    edges = graph()
    found = cycles(edges)
    lines = []
    for component in found:
        inside = [e for e in edges if e.source in component and e.target in component]
        lines.append(" <-> ".join(component) + ": " +
                     ", ".join(f"{e.source}:{e.line} -> {e.target}" for e in inside))  # fmt: skip
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_no_import_climbs_a_floor() -> None:
    edges = graph()
    upward = [e for e in edges if FLOOR.get(unit(e.target), 0) < FLOOR.get(unit(e.source), 0)]
    assert not upward, "imports from a lower floor up to a higher one:\n" + "\n".join(
        f"{e.source}:{e.line} imports {e.target}" for e in upward
    )


def test_packages_on_one_floor_import_each_other_one_way() -> None:
    pairs: dict[tuple[str, str], Edge] = {}
    for e in graph():
        a, b = unit(e.source), unit(e.target)
        if a != b and FLOOR.get(a) == FLOOR.get(b):
            pairs.setdefault((a, b), e)
    both = [(e, pairs[(b, a)]) for (a, b), e in pairs.items() if (b, a) in pairs and a < b]
    assert not both, "packages of one floor importing each other:\n" + "\n".join(
        f"{e.source}:{e.line} imports {e.target}, {f.source}:{f.line} imports {f.target}"
        for e, f in both
    )


def test_the_checks_see_relative_and_function_level_imports(tmp_path: Path) -> None:
    """The parser itself: relative imports resolve, nested and TYPE_CHECKING ones count."""
    pkg = tmp_path / "gyre" / "proxy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text("")
    (pkg / "admin.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import app\n"
        "def f():\n    from gyre.runtime import x\n"
    )
    known = {"gyre.proxy": pkg / "__init__.py", "gyre.proxy.app": pkg / "app.py",
             "gyre.proxy.admin": pkg / "admin.py", "gyre.runtime": pkg / "__init__.py"}  # fmt: skip
    edges = imports("gyre.proxy.admin", pkg / "admin.py", known)
    assert [(e.line, e.target) for e in edges] == [(3, "gyre.proxy.app"), (5, "gyre.runtime")]
    assert cycles([Edge("a", 1, "b"), Edge("b", 2, "c"), Edge("c", 3, "a")]) == [["a", "b", "c"]]


RANK_ROOMS = ("gyre.runtime.coordinator", "gyre.runtime.cell", "gyre.runtime.proxy_node")
"""The runtime's rank packages: each speaks to the others only through `gyre.runtime.shared`."""


def room(module: str) -> str | None:
    """The runtime room a module lives in (a rank package or `shared`), else None."""
    for r in (*RANK_ROOMS, "gyre.runtime.shared"):
        if module == r or module.startswith(r + "."):
            return r
    return None


def test_the_rank_rooms_meet_only_in_shared() -> None:
    """No arrow from one rank's package into another's, and none from `shared` up into any
    of them: a rank's code is read in its own room plus the shared one."""
    crossing = [e for e in graph()
                if room(e.source) and room(e.target) in RANK_ROOMS
                and room(e.source) != room(e.target)]  # fmt: skip
    assert not crossing, "imports between the runtime's rooms:\n" + "\n".join(
        f"{e.source}:{e.line} imports {e.target}" for e in crossing
    )


def test_the_preflight_imports_no_rank_room() -> None:
    """The preflight asks each domain through `gyre.runtime.shared.checks.Check`: the checks
    live in `shared` (or below), so nothing it reaches, directly or through another module,
    is a rank's module."""
    succ: dict[str, set[str]] = {}
    for e in graph():
        succ.setdefault(e.source, set()).add(e.target)
    reached: set[str] = set()
    todo = ["gyre.runtime.preflight"]
    while todo:
        for target in succ.get(todo.pop(), set()) - reached:
            reached.add(target)
            todo.append(target)
    into = sorted(m for m in reached if room(m) in RANK_ROOMS)
    assert not into, f"gyre.runtime.preflight reaches the rank rooms' modules: {into}"
