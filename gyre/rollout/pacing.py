"""Paced devices on this machine: real work held to its modelled duration (docs/pacing.md).

A paced run (`pace.scale` > 0) keeps the tiny model's real tokens and real training, but each
piece of device work takes the time the cluster's accelerator would take
(`gyre.schedule.devices`, the cost model `gyre sim` uses), divided by the scale:

* `Pacer` holds one piece of work — a role switch, a training pass, an update, a
  publication — until `modelled_s / scale` wall seconds have passed since it began;
* `PacedCalls` does it for an engine's model calls, under processor sharing: a call is on
  the engine (its load) from arrival; when its real generation ends, its nominal seconds are
  known (`CallCost`) and it is delivered once the engine's virtual clock (`EnginePool`, one
  engine) has advanced that far since its arrival.

Work that took longer than its modelled time is an *overrun*: this machine was slower than
the modelled device (CPU contention). Overruns are counted with their excess seconds, never
hidden: a paced result distorted by this machine says so (`stats`).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.schedule.devices import EnginePace, EnginePool

TOLERANCE_S = 0.005
"""Lateness of a real piece of work, wall seconds, that is not yet counted as an overrun."""


@dataclass(slots=True)
class PaceStats:
    """What pacing held and where real work overran its modelled time."""

    work: int = 0
    """Pieces of device work paced."""
    modelled_s: float = 0.0
    """Their modelled wall seconds (modelled seconds / scale)."""
    overruns: int = 0
    """Pieces whose real work took longer than that."""
    overrun_s: float = 0.0
    """Wall seconds by which they overran."""

    def add(self, modelled_wall_s: float, late_s: float) -> None:
        self.work += 1
        self.modelled_s += modelled_wall_s
        if late_s > TOLERANCE_S:
            self.overruns += 1
            self.overrun_s += late_s

    def to_dict(self) -> dict[str, float]:
        return {"work": self.work, "modelled_s": round(self.modelled_s, 3),
                "overruns": self.overruns, "overrun_s": round(self.overrun_s, 3)}  # fmt: skip


def merged(parts: list[dict[str, float]]) -> dict[str, float]:
    """Several `PaceStats.to_dict()` summed, with `overrun_share`: the overrun seconds over
    the modelled ones (0 when nothing overran)."""
    total = {k: sum(float(p.get(k, 0)) for p in parts)
             for k in ("work", "modelled_s", "overruns", "overrun_s")}  # fmt: skip
    total["overrun_share"] = (
        total["overrun_s"] / total["modelled_s"] if total["modelled_s"] else 0.0
    )
    return total


class Pacer:
    """Holds each piece of work of one process to its modelled duration."""

    def __init__(self, scale: float, report: Path | None = None) -> None:
        if not scale > 0:
            raise ValueError(f"scale: {scale}; a pacer needs > 0")
        self.scale = scale
        self.stats = PaceStats()
        self.report = report

    def hold(self, modelled_s: float, since: float) -> None:
        """Wait until `modelled_s` (modelled seconds) has passed since `since`
        (`time.monotonic()` when the work began); late work is counted, not waited for."""
        wall = modelled_s / self.scale
        late = time.monotonic() - (since + wall)
        if late < 0:
            time.sleep(-late)
        self.stats.add(wall, late)
        if self.report is not None:
            _write_json(self.report, self.stats.to_dict())


Deliver = Callable[[dict[str, Any]], None]
"""How an engine hands a finished call's response body back (the HTTP handler's callback)."""


@dataclass(slots=True)
class _Held:
    rid: str
    deliver: Deliver
    body: dict[str, Any]
    nominal: float
    arrival: float  # time.time() at arrival: the paced e2e latency is measured from it


class PacedCalls:
    """An engine's model calls, each delivered when its modelled generation has finished."""

    def __init__(self, pace: EnginePace) -> None:
        self.scale, self.calls = pace.scale, pace.calls
        self.stats = PaceStats()
        self._pool = EnginePool(1, pace.model)
        self._cond = threading.Condition()
        self._start: dict[int, float] = {}  # call on the engine -> virtual clock at arrival
        self._held: dict[int, _Held] = {}  # generated, waiting for its modelled end
        self._next = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="gyre-pace", daemon=True)
        self._thread.start()

    def _now(self) -> float:
        return time.monotonic() * self.scale  # modelled seconds

    def wrap(self, rid: str, deliver: Deliver) -> Deliver:
        """Put a call on the engine now; the returned callback replaces its `deliver`."""
        arrival = time.time()
        with self._cond:
            key = self._next
            self._next += 1
            self._pool.add(key, 0, math.inf, self._now())
            self._start[key] = self._pool.clock[0]
            self._cond.notify_all()  # the load changed: every held call's end moves

        def paced(body: dict[str, Any]) -> None:
            meta = body["meta_info"]
            if meta["finish_reason"]["type"] == "abort":
                self._leave(key)
                deliver(body)
                return
            nominal = self.calls.nominal_s(
                int(meta["prompt_tokens"]), int(meta["cached_tokens"]),
                int(meta["completion_tokens"]),
            )  # fmt: skip
            self._generated(key, _Held(rid, deliver, body, nominal, arrival))

        return paced

    def _leave(self, key: int) -> None:
        with self._cond:
            if self._start.pop(key, None) is not None:
                self._pool.remove(key, self._now())
                self._held.pop(key, None)
                self._cond.notify_all()

    def _generated(self, key: int, held: _Held) -> None:
        """The real call ended: hold it for the rest of its modelled time, or deliver it now
        (late) if the engine's clock has already served its nominal seconds."""
        with self._cond:
            now = self._now()
            rate = self._pool.rate[0]
            self._pool.remove(key, now)
            served = self._pool.clock[0] - self._start[key]
            if served < held.nominal:
                self._pool.add(key, 0, held.nominal - served, now)
                self._held[key] = held
                self._cond.notify_all()
                return
            del self._start[key]
            self.stats.add(held.nominal / self.scale, (served - held.nominal) / (rate * self.scale))
        self._deliver(held)

    def abort(self, rid: str | None, message: str) -> int:
        """End held calls (`rid`, or all) as aborted: a switch or an abort reaches a call
        whose modelled generation is still running."""
        with self._cond:
            keys = [k for k, h in self._held.items() if rid is None or h.rid == rid]
            ended = [self._held.pop(k) for k in keys]
            for key in keys:
                self._pool.remove(key, self._now())
                del self._start[key]
            self._cond.notify_all()
        for held in ended:
            held.body["meta_info"]["finish_reason"] = {"type": "abort", "message": message}
            self._deliver(held)
        return len(ended)

    def stop(self) -> None:
        self.abort(None, "engine shutting down")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                held = None
                while held is None:
                    if self._stopping:
                        return
                    nxt = self._pool.next_completion(0)
                    now = self._now()
                    if nxt is not None and nxt[0] <= now and nxt[1] in self._held:
                        key = nxt[1]
                        held = self._held.pop(key)
                        self._pool.remove(key, now)
                        del self._start[key]
                        self.stats.add(held.nominal / self.scale, 0.0)
                        break
                    due = None if nxt is None or math.isinf(nxt[0]) else nxt[0]
                    self._cond.wait(None if due is None else (due - now) / self.scale)
            self._deliver(held)

    @staticmethod
    def _deliver(held: _Held) -> None:
        held.body["meta_info"]["e2e_latency"] = time.time() - held.arrival
        held.deliver(held.body)

    def snapshot(self) -> dict[str, float]:
        with self._cond:
            return {**self.stats.to_dict(), "load": self._pool.load[0]}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
