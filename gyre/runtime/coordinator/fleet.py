"""The coordinator's engine fleet: one record per rollout engine, as the coordinator knows it.

Cells' engines are 0..K-1 (the cell's index), standalone ones K..; each record holds its URL,
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


class Fleet:
    """Every engine of the job, by index, in the order they first reported ready."""

    def __init__(self) -> None:
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

    def fix_in_training(self, cell: int) -> None:
        """Async: the cell trains from the start; its switch is no scheduler switch."""
        self[cell].fixed_in_training = True

    def switch_to_train(self, cell: int, now: float) -> None:
        """The cell's engine drains (acknowledged: its Drained answer sends ToTrain)."""
        self[cell].switch_started = now
        self.drain(cell)  # sent once the reroutes are known
        self[cell].switching_to_train = True

    def switch_to_rollout(self, cell: int, now: float) -> None:
        self[cell].switch_started = now

    def drained(self, cell: int) -> dict[str, str]:
        """The proxy drained the cell's engine: the KV routes its cell hands over now."""
        engine = self[cell]
        routes, engine.kv_routes = engine.kv_routes, {}
        return routes

    def switched(self, cell: int, now: float) -> float:
        """The cell is in its new role: the seconds since its switch was decided."""
        engine = self[cell]
        started = now if engine.switch_started is None else engine.switch_started
        engine.switch_started = None
        return now - started

    def leave_fixed(self, cell: int) -> bool:
        """Whether the cell's switch was the fixed one at startup (cleared: once only)."""
        engine = self[cell]
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
