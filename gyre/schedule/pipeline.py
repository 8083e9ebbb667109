"""A window of micro-steps through pipeline stages: the 1F1B order a Megatron cell runs
(`gyre.train.megatron.pipeline`) and the time that order takes (`window_s`), which the
cost model (`gyre.schedule.devices.CostConfig.window_s`) charges for a pass in the simulator
and in the paced runtime alike.

A cell of P stages holds 1/P of the layers per stage; a pass hands it a window of m
micro-steps. In Megatron's non-interleaved 1F1B order stage s runs P - 1 - s warm-up
forwards, then a forward and the oldest backward in turn, then the remaining backwards; a
forward waits for the previous stage's forward of its micro-step, a backward for the next
stage's backward (the last stage's for its own forward). For m equal micro-steps each stage
then idles (P - 1) / (m + P - 1) of the window (`bubble_share`); one micro-step per pass
idles it (P - 1) / P.

    one_f_one_b(stage=0, stages=2, microsteps=3)  # [F0, F1, B0, F2, B1, B2]
    window_s([1.0] * 4, [2.0] * 4, stages=2)      # 15.0: (4 + 2 - 1) x 3
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Pass = tuple[Literal["F", "B"], int]  # a forward or a backward of the window's i-th micro-step


def one_f_one_b(stage: int, stages: int, microsteps: int, *, backward: bool = True) -> list[Pass]:
    """Stage `stage`'s order of passes over a window (Megatron's non-interleaved 1F1B):
    warm-up forwards until the first backward can come back (P - 1 - stage of them), then a
    forward and the oldest backward in turn, then the remaining backwards. Without a
    backward (a prepass) the forwards in order."""
    if not backward:
        return [("F", i) for i in range(microsteps)]
    warmup = min(stages - stage - 1, microsteps)
    order: list[Pass] = [("F", i) for i in range(warmup)]
    for i in range(microsteps - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(microsteps - warmup, microsteps)]


def window_s(forward_s: Sequence[float], backward_s: Sequence[float] | None, stages: int) -> float:
    """Seconds of a window through `stages` stages run in `one_f_one_b` order, micro-step i
    taking `forward_s[i]` forward and `backward_s[i]` backward on every stage (None: forwards
    only); transfers free. Each pass ends at max(its stage's previous pass, the pass it
    waits for) + its own time; the window ends with the last pass of any stage."""
    m, grad = len(forward_s), backward_s is not None
    orders = [one_f_one_b(s, stages, m, backward=grad) for s in range(stages)]
    end: dict[tuple[int, Pass], float] = {}
    pending = [list(reversed(order)) for order in orders]  # each stage's passes, next last
    clock = [0.0] * stages
    while any(pending):
        moved = False
        for s in range(stages):
            while pending[s]:
                kind, i = pending[s][-1]
                after = _waits_for(s, stages, kind, i)
                if after is not None and after not in end:
                    break  # its input is not computed yet: another stage first
                start = max(clock[s], end[after] if after is not None else 0.0)
                took = forward_s[i] if kind == "F" else backward_s[i]  # type: ignore[index]
                clock[s] = end[(s, (kind, i))] = start + took
                pending[s].pop()
                moved = True
        assert moved, "1F1B order deadlocked"
    return max(clock, default=0.0)


def _waits_for(stage: int, stages: int, kind: str, i: int) -> tuple[int, Pass] | None:
    """The pass whose output a stage's pass needs (None: the first stage's forward)."""
    if kind == "F":
        return (stage - 1, ("F", i)) if stage > 0 else None
    return (stage + 1, ("B", i)) if stage < stages - 1 else (stage, ("F", i))


def bubble_share(stages: int, microsteps: int) -> float:
    """The share of a window a stage idles, for `microsteps` equal micro-steps."""
    return (stages - 1) / (microsteps + stages - 1)
