"""What a window of micro-steps through pipeline stages costs (`gyre.schedule.pipeline`):
the timeline of the runtime's 1F1B order against a slow tick-by-tick reference, its bubble
against the closed form, and the one charge the simulator and the paced cells both take."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.rollout.pacing import Pacer
from gyre.runtime.cell.pace import Pace
from gyre.schedule import events as ev
from gyre.schedule.devices import CostConfig, PaceConfig
from gyre.schedule.pipeline import bubble_share, one_f_one_b, window_s
from gyre.sim import SimConfig, Simulator
from gyre.train.packing import MicroStep, TokenRow


def ticked(forward: list[int], backward: list[int] | None, stages: int) -> int:
    """The slow, obvious timeline: a clock that ticks by one; at each tick every idle stage
    starts its next pass in its 1F1B order if the pass it needs has ended by then, and is
    busy for that pass's ticks. Returns the tick at which the last pass ends."""
    m = len(forward)
    todo = [deque(one_f_one_b(s, stages, m, backward=backward is not None))
            for s in range(stages)]  # fmt: skip
    ended: dict[tuple[str, int, int], int] = {}
    busy_until = [0] * stages
    tick = 0
    while any(todo):
        for s in range(stages):
            if busy_until[s] > tick or not todo[s]:
                continue
            kind, i = todo[s][0]
            if kind == "F":
                need = ("F", i, s - 1) if s > 0 else None
            else:
                need = ("B", i, s + 1) if s < stages - 1 else ("F", i, s)
            if need is not None and ended.get(need, tick + 1) > tick:
                continue
            todo[s].popleft()
            took = forward[i] if kind == "F" else backward[i]  # type: ignore[index]
            busy_until[s] = ended[(kind, i, s)] = tick + took
        tick += 1
        assert tick < 10_000, "the reference stalled"
    return max(busy_until)


durations = st.lists(st.integers(1, 6), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 5), forward=durations, data=st.data())
def test_the_window_timeline_equals_the_tick_by_tick_reference(
    stages: int, forward: list[int], data: st.DataObject
) -> None:
    backward = data.draw(st.none() | st.lists(st.integers(1, 9), min_size=len(forward),
                                              max_size=len(forward)))  # fmt: skip
    assert window_s(forward, backward, stages) == ticked(forward, backward, stages)


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_equal_micro_steps_idle_each_stage_the_closed_form_bubble(stages: int, m: int) -> None:
    one = 1.0 + 2.0  # a micro-step's forward + backward on one stage
    wall = window_s([1.0] * m, [2.0] * m, stages)
    assert 1 - m * one / wall == pytest.approx(bubble_share(stages, m))
    assert window_s([1.0] * m, None, stages) == m + stages - 1  # a prepass window too


def _step(index: int, tokens: int) -> MicroStep:
    import numpy as np

    targets = np.arange(tokens) > 0
    row = TokenRow(execution_id=f"e{index}", group_id="g0", policy_version=0,
                   ids=np.zeros(tokens, np.int64), targets=targets,
                   behaviour_logprobs=np.zeros(tokens), advantage=1.0,
                   execution_targets=tokens - 1, weights=targets / (tokens - 1))  # fmt: skip
    return MicroStep(index=index, rows=(row,))


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("work", [ev.Work.PREPASS, ev.Work.GRADIENT])
def test_the_simulator_and_a_paced_cell_charge_a_window_the_same(
    stages: int, m: int, work: ev.Work
) -> None:
    """The simulator's claim of a window and a paced cell's pass over the same micro-steps
    take the same modelled seconds, and it is the pipeline's timeline."""
    costs = CostConfig(pipeline_stages=stages, train_tokens_per_node_s=100, prepass_ratio=0.25)
    tokens = [300 + 50 * i for i in range(m)]
    sim = Simulator(SimConfig(costs=costs), "elastic")
    sim.batch_tokens[0] = deque(tokens)
    sim.batch_gradients[0] = deque(tokens)
    sim._claim(ev.ClaimMicroStep(cell=0, batch=0, work=work, count=m))
    simulated = sim.running[0]

    nodes = sim.nodes_per_cell
    pace = Pace(PaceConfig(scale=1e9, nodes_per_cell=nodes, costs=costs), Pacer(1e9))
    assert pace.pacer is not None
    pace.train_pass([_step(i, t) for i, t in enumerate(tokens)], prepass=work is ev.Work.PREPASS)
    assert pace.pacer.stats.modelled_s * 1e9 == pytest.approx(simulated, rel=1e-9)  # wall s

    passes = [t / (nodes * 100) for t in tokens]
    if work is ev.Work.PREPASS:
        expected = window_s([p * 0.25 for p in passes], None, stages)
    else:
        expected = window_s([p * 0.25 for p in passes], [p * 0.75 for p in passes], stages)
    assert simulated == pytest.approx(expected)
    assert simulated > sum(passes) * (0.25 if work is ev.Work.PREPASS else 1) or stages == 1


def test_the_order_is_megatrons_one_forward_one_backward() -> None:
    assert one_f_one_b(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert one_f_one_b(1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert one_f_one_b(0, 3, 2, backward=False) == [("F", 0), ("F", 1)]


@given(stages=st.integers(1, 6), m=st.integers(1, 10))
def test_each_stage_holds_at_most_its_share_of_micro_steps_in_flight(stages: int, m: int) -> None:
    """1F1B's memory bound: stage s keeps at most P - s micro-steps' activations (forwards
    whose backward has not run), every micro-step once forward and once backward, in order."""
    for s in range(stages):
        order = one_f_one_b(s, stages, m)
        assert [i for k, i in order if k == "F"] == list(range(m))
        assert [i for k, i in order if k == "B"] == list(range(m))
        flight = peak = 0
        for kind, _ in order:
            flight += 1 if kind == "F" else -1
            peak = max(peak, flight)
        assert peak == min(stages - s, m)
