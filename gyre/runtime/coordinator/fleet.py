"""The coordinator's engine fleet: one record per rollout engine, as the coordinator knows it.

Cells' engines are 0..K·E-1 (cell c's E engines c·E .. c·E+E-1; E = 1: the cell's index),
standalone ones K·E..; a cell's switch drains all of its engines and goes on once the proxy
acknowledged every one; each record holds its URL,
the drain the proxy is still to be sent (routes of executions moved off it), the KV routes
its cell hands over when it switches to training, when its switch started, and whether it
is being restarted. The coordinator calls the fleet as things happen — `ready`, `lost`,
`reroute`, `switch_to_train`, `drained`, `switched` — and sends what `drains()` returns
once the scheduler's actions for an event are carried out. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.runtime.shared import messages as msg
from gyre.vocabulary import EngineId


@dataclass(slots=True)
class Engine:
    """One rollout engine."""

    id: EngineId
    url: str = ""  # where it serves (empty until it first reports ready)
    drain: dict[str, str] | None = None  # a Drain to send: {execution: new engine id}
    kv_routes: dict[str, str] = field(default_factory=dict)  # {execution: new engine's URL}
    switch_started: float | None = None  # when its cell's switch was decided
    fixed_in_training: bool = False  # Async: its cell trains from the start (no SwitchDone)
    respawning: bool = False  # lost and not yet back
    switching_to_train: bool = False  # its cell's acknowledged Drain is unsent
    acked: bool = False  # the proxy drained it for its cell's switch; its siblings not yet


class Fleet:
    """Every engine of the job, by index, in the order they first reported ready."""

    def __init__(self, per_cell: int = 1) -> None:
        self.per_cell = per_cell  # E: engines of one cell
        self.engines: dict[int, Engine] = {}
        self._draining: list[Engine] = []  # drains to send, in the order they were decided

    def __getitem__(self, e: int) -> Engine:
        engine = self.engines.get(e)
        if engine is None:
            engine = self.engines[e] = Engine(EngineId(e))
        return engine

    @property
    def respawning(self) -> set[int]:
        """Engines lost and not yet back."""
        return {e for e, engine in self.engines.items() if engine.respawning}

    def urls(self) -> dict[str, str]:
        """Engine id -> URL, as the proxy names them."""
        return {str(engine.id): engine.url for engine in self.engines.values() if engine.url}

    def ready(self, e: int, url: str) -> None:
        """Engine `e` serves at `url` (started, or restarted after a loss)."""
        engine = self[e]
        engine.url, engine.respawning = url, False

    def lost(self, e: int) -> None:
        """Engine `e` died: it is restarted; its calls move (an ack-less drain); its KV is gone."""
        engine = self[e]
        engine.respawning = True
        engine.kv_routes = {}
        self.drain(e)

    def drain(self, e: int) -> dict[str, str]:
        """The routes of the Drain to send for engine `e` (one per event, sent by `drains`)."""
        engine = self[e]
        if engine.drain is None:
            engine.drain = {}
            self._draining.append(engine)
        return engine.drain

    def reroute(self, execution_id: str, source: int, destination: int) -> None:
        """Move an execution's calls; its KV follows it unless it died with the engine."""
        self.drain(source)[execution_id] = str(EngineId(destination))
        # docs/engine.md "KV-cache migration"
        if self[destination].url and not self[source].respawning:
            self[source].kv_routes[execution_id] = self[destination].url

    def of_cell(self, cell: int) -> range:
        """The engine ids of `cell`."""
        return range(cell * self.per_cell, (cell + 1) * self.per_cell)

    def cell_of(self, e: int, cells: int) -> int | None:
        """The cell engine `e` belongs to (None: a standalone engine) of `cells` cells."""
        return e // self.per_cell if e < cells * self.per_cell else None

    def _first(self, cell: int) -> Engine:
        """The record a cell's switch is timed on: its first engine's."""
        return self[cell * self.per_cell]

    def fix_in_training(self, cell: int) -> None:
        """Async: the cell trains from the start; its switch is no scheduler switch."""
        self._first(cell).fixed_in_training = True

    def switch_to_train(self, cell: int, now: float) -> None:
        """The cell's engines drain (acknowledged: the last Drained answer sends ToTrain)."""
        self._first(cell).switch_started = now
        for e in self.of_cell(cell):
            self.drain(e)  # sent once the reroutes are known
            self[e].switching_to_train = True

    def switch_to_rollout(self, cell: int, now: float) -> None:
        self._first(cell).switch_started = now

    def drained(self, e: int) -> dict[str, str] | None:
        """The proxy drained engine `e` for its cell's switch: once every engine of the cell
        is drained, the KV routes the cell hands over now (None until then)."""
        self[e].acked = True
        siblings = [self[s] for s in self.of_cell(e // self.per_cell)]
        if not all(s.acked for s in siblings):
            return None
        routes: dict[str, str] = {}
        for s in siblings:
            routes |= s.kv_routes
            s.kv_routes, s.acked = {}, False
        return routes

    def switched(self, cell: int, now: float) -> float:
        """The cell is in its new role: the seconds since its switch was decided."""
        engine = self._first(cell)
        started = now if engine.switch_started is None else engine.switch_started
        engine.switch_started = None
        return now - started

    def leave_fixed(self, cell: int) -> bool:
        """Whether the cell's switch was the fixed one at startup (cleared: once only)."""
        engine = self._first(cell)
        fixed, engine.fixed_in_training = engine.fixed_in_training, False
        return fixed

    def drains(self) -> list[msg.Drain]:
        """The Drains decided since the last call: a lost engine's only moves calls, a
        switching cell's is acknowledged."""
        out = []
        for engine in self._draining:
            assert engine.drain is not None
            out.append(msg.Drain(str(engine.id), engine.drain, ack=engine.switching_to_train))
            engine.drain, engine.switching_to_train = None, False
        self._draining = []
        return out
