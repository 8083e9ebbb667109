"""Gyre's runtime: the whole job as one MPI world (coordinator, proxy node, cells).

    python -m gyre.runtime.main CONFIG      # one rank (mpiexec / srun start all of them)
    gyre run [CONFIG]                       # spawns mpiexec on this machine, shows progress
    gyre report RUN_DIR                     # plots + HTML from the run's trace

Modules: `config` (RunConfig), `layout` (rank -> component), `main` (per-rank entry),
`coordinator` (with its `fleet` of engines, `ledger` of groups and executions, `resume`
and `progress`), `proxy_node`, `cell`, `engine_host`, `training`, `record`, `wire`, `cli`,
`report`. See docs/runtime.md.
"""
