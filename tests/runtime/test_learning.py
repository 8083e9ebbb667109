"""The default job learns: a real `gyre run` of templates/local.yaml (tiny model from its random
init, reference agent, learnable `notes` task, three cells) raises the held-out reward.

Everything is the unmodified loop — harness → proxy (TITO) → trajectory trees → partial
scoring → admission → objective → streaming training on the runtime's cells → publication
→ the next rollouts — and the before/after numbers come from `gyre eval` on held-out task
instances never trained on. How far a run gets varies with scheduling order: most runs gain
~+0.7, some settle on a plateau near 0.375 (a gain of ~+0.15-0.2; docs/runtime.md "Does it
learn?"). So the test asks whether the policy improved, not by how much: on the same 48
held-out instances the final policy must beat the initial one on significantly more
instances than it loses (a one-sided sign test, p < 0.01; an untrained policy's wins and
losses split evenly), and the training reward of the last 10 steps must exceed the first 10's.
48 instances, not 16: a plateau run wins ~11 of every 14 instances that differ, which clears
p < 0.01 in ~40% of 16-instance evaluations (a CI failure: 11 up, 3 down, p = 0.029) and in
~95% of 48-instance ones (binomial arithmetic in `test_sign_test_against_known_values`); the
32 extra executions per policy cost ~25 s.

The run is the session's shared `learning_run` (tests/worlds.py `learning_world`): the
template as it is, plus validation while training (`eval.every_steps=20`, 2 held-out
instances a point), which tests/runtime/test_validation.py checks on the same run.
"""

from __future__ import annotations

import json
import math

import pytest
from worlds import LEARNING_STEPS, Learned

from gyre.trajectory.reader import TraceReader


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided sign test: P(at least `wins` of `wins + losses` fair coin flips)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0


def test_sign_test_against_known_values() -> None:
    assert sign_test_p(14, 2) == (120 + 16 + 1) / 2**16  # the plateau run: p = 0.0021
    assert sign_test_p(8, 8) > 0.5 and sign_test_p(0, 0) == 1.0
    assert sign_test_p(10, 6) > 0.01  # 10 of 16: chance
    # a plateau run (wins 11 of 14 differing instances, q = 0.786): the chance that an
    # evaluation of n differing instances misses p < 0.01
    q = 11 / 14

    def miss(n: int) -> float:
        need = min(w for w in range(n + 1) if sign_test_p(w, n - w) < 0.01)
        return sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(need))

    assert 0.55 < miss(14) < 0.65 and miss(42) < 0.06  # 16 vs 48 instances (7/8 differ)


@pytest.mark.mpi
@pytest.mark.slow
def test_the_default_job_raises_the_held_out_reward(learning_run: Learned) -> None:
    run, ev, run_dir = learning_run.run, learning_run.eval, learning_run.run_dir
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert ev is not None and ev.returncode == 0, ev and ev.stdout[-3000:] + ev.stderr[-3000:]
    out = ev.stdout
    before, after = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert (before["name"], after["name"]) == ("initial", "final")
    assert before["version"] == 0 and after["version"] == LEARNING_STEPS
    assert after["n"] == before["n"] == 48
    pairs = [(before["rewards"][k], after["rewards"][k]) for k in before["rewards"]]
    wins = sum(1 for b, a in pairs if a is not None and b is not None and a > b)
    losses = sum(1 for b, a in pairs if a is not None and b is not None and a < b)
    assert sign_test_p(wins, losses) < 0.01, (wins, losses, before["mean"], after["mean"])

    with TraceReader(run_dir / "trace.h5") as r:
        rows = r.rows("steps")
    metric: dict[str, dict[int, float]] = {}
    for row in rows:
        metric.setdefault(row["name"], {})[int(row["step"])] = float(row["value"])
    # a step carries signal unless every group's rewards tie (e.g. all solved: nothing to
    # learn) or the sequence-ratio gate took the executions that had an advantage (seen:
    # one group tied, the other [0, .5, .5, 1] with both non-zero advantages gated; the
    # step's objective is then exactly 0, computed before any gradient moves)
    silent = [s for s, v in metric["grad_norm"].items() if not v > 0]
    explained = [s for s in silent
                 if metric["tied_groups"][s] == 1.0 or metric["gated_executions"][s] > 0]  # fmt: skip
    assert explained == silent, (silent, metric["tied_groups"], metric["gated_executions"])
    assert all(metric["objective"][s] == 0.0 for s in silent), metric["objective"]
    assert len(silent) <= len(metric["grad_norm"]) // 4, silent
    reward = [metric["reward_mean"][s] for s in sorted(metric["reward_mean"])]
    assert sum(reward[-10:]) > sum(reward[:10]), reward
    # the recorded held-out results are what `gyre report` plots
    saved = json.loads((run_dir / "eval.json").read_text())["results"]
    assert [r["name"] for r in saved] == ["initial", "final"]
