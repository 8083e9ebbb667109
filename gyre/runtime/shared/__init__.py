"""What every rank of a Gyre job shares: the run config, the world's layout and placement,
the messages and the control channel that carries them, checkpoints and policies on disk,
this rank's address and its start-up clock; and the preflight's checks of each domain
(`checks`: the interface; `harness`, `placement`, `run_directory`) with what a continuing job
takes over from its run directory (`takeover`).

The three rank packages (`gyre.runtime.coordinator`, `gyre.runtime.cell`,
`gyre.runtime.proxy_node`) never import each other: everything they say to one another is a
message of `gyre.runtime.shared.messages` over `gyre.runtime.shared.wire`.
"""
