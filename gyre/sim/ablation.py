"""Table 1 of the paper as runnable templates, and the normalized report beside it.

`run_table1()` runs templates/sim/table1/{A0..A3,C0..C3,E0..E2}.yaml (12 NL2RepoBench steps
at E[d] = 1.5) and returns (name, hours, hours / E0, paper's time / E0). The paper column is
derived from the percentages the paper gives (docs/simulator.md, "Table 1").
"""

from __future__ import annotations

from pathlib import Path

from gyre.errors import ConfigError
from gyre.sim.config import load_sim_config
from gyre.sim.report import SimResult
from gyre.sim.simulator import Simulator

TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "sim"

# Time / E0 from the paper's text: E1 +10.9 %; A3 = 1.24 x E1; A0 = A3 / (1 - 11.6 %);
# A1 = A0 + 7.7 %; A2 = A0 + 29.9 %; C2 = 1.19 x E0; C1 = C2 / (1 - 14.8 %);
# C0 = C1 / (1 - 2.9 %); C3 = C2 + 7.6 %; E2 = 16.47 / 16.12.
PAPER_TIME_OVER_E0: dict[str, float] = {
    "A0": 1.555,
    "A1": 1.675,
    "A2": 2.020,
    "A3": 1.375,
    "C0": 1.438,
    "C1": 1.397,
    "C2": 1.190,
    "C3": 1.280,
    "E0": 1.000,
    "E1": 1.109,
    "E2": 1.022,
}
PAPER_E0_HOURS = 16.12


def template(name: str) -> Path:
    """The template file of a Table 1 configuration."""
    if name not in PAPER_TIME_OVER_E0:
        allowed = ", ".join(PAPER_TIME_OVER_E0)
        raise ConfigError(f"ablation: {name!r} is unknown; allowed: {allowed} or table1")
    return TEMPLATES / "table1" / f"{name}.yaml"


def run_ablation(name: str, steps: int | None = None, seed: int | None = None) -> SimResult:
    cfg = load_sim_config(template(name))
    return Simulator(cfg, cfg.policy, steps=steps, seed=seed).run()


def run_table1(
    steps: int | None = None, seed: int | None = None
) -> list[tuple[str, SimResult, float, float]]:
    """Every configuration, with time / E0 measured and in the paper."""
    results = {name: run_ablation(name, steps, seed) for name in PAPER_TIME_OVER_E0}
    e0 = results["E0"].total_h
    return [(n, r, r.total_h / e0, PAPER_TIME_OVER_E0[n]) for n, r in results.items()]


def format_table1(rows: list[tuple[str, SimResult, float, float]]) -> str:
    lines = [f"{'config':<7}{'policy':<10}{'φ':>5}{'μ':>3}{'hours':>8}{'/E0':>7}{'paper /E0':>11}"]
    for name, r, ratio, paper in rows:
        lines.append(
            f"{name:<7}{r.policy:<10}{r.phi:>5.1f}{r.mu:>3}{r.total_h:>8.2f}{ratio:>7.3f}{paper:>11.3f}"
        )
    lines.append(f"(paper E0: {PAPER_E0_HOURS} h for 12 steps)")
    return "\n".join(lines)
