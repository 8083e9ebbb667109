"""The coordinator's rank (world rank 0): the scheduler driven with real processes, its
ledger of groups and executions, the trace it writes, streaming training's batches, the take-over
of a resumed run, and what the run reports.

`coordinator.Coordinator` is the loop; the other modules are the rooms it works in.
"""
