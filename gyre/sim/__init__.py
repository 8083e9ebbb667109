"""Gyre's discrete-event simulator: the real scheduler driven by a synthetic workload.

    from gyre.sim import Simulator, load_sim_config
    result = Simulator(load_sim_config("templates/sim/nl2repo.yaml"), "elastic").run()

See docs/simulator.md for the workload model and the NL2RepoBench calibration.
"""

from gyre.sim.config import CostConfig, PolicySpec, SimConfig, load_sim_config
from gyre.sim.report import SimResult
from gyre.sim.simulator import Simulator
from gyre.sim.workload import WorkloadConfig

__all__ = [
    "CostConfig",
    "PolicySpec",
    "SimConfig",
    "SimResult",
    "Simulator",
    "WorkloadConfig",
    "load_sim_config",
]
