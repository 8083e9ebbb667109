"""Gyre: elastic online reinforcement learning for xLong-horizon LLM agents.

Gyre trains agents through unmodified black-box harnesses (Claude Code, the reference
agent, ...). Two planes cooperate: the elastic scheduling plane (`gyre.schedule`, driven by
the coordinator in `gyre.runtime` and by the simulator in `gyre.sim`) moves cells between
rollout and training, and the trajectory plane (`gyre.proxy`, `gyre.trajectory`,
`gyre.train`) records every model call token-in/token-out and turns executions into
training data. See README.md and docs/ for the map.
"""

__version__ = "0.1.0"
