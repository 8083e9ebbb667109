"""Gyre's runtime: the whole job as one MPI world (coordinator, proxy node, cells).

    python -m gyre.runtime.main CONFIG      # one rank (mpiexec / srun start all of them)
    gyre run [CONFIG]                       # spawns mpiexec on this machine, shows progress
    gyre report RUN_DIR                     # plots + HTML from the run's trace

A room per rank, and what they share (docs/architecture.md):

* `coordinator/` — world rank 0: the scheduler driven with real processes;
* `proxy_node/` — world rank 1: the proxy, the harness pool, the evaluator;
* `cell/` — every cell rank: an engine leader or a follower, training its replica;
* `shared/` — the run config, layout, placement, messages and wire, checkpoints, policies.

The three rank rooms import only `shared/` (and the planes below the runtime), never each
other. Beside them stand the runtime's doors: `main` (one rank's entry, which builds its
role in `roles`), `preflight` (what a config must pass before any process starts), `cli`
(`gyre run`, `gyre eval`, `gyre report`), `evaluation` and `report`.
"""
