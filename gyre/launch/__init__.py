"""Slurm-native launch of a Gyre run as one heterogeneous job.

`gyre.launch.config.SlurmConfig` is the `slurm:` section of a run config; `render` turns a
config into an sbatch script (`gyre render`), `submit` sends it through submitit
(`gyre submit`), `cluster` checks a config against the partitions `sinfo` reports, and
`probe` is a tiny MPI entry that shows how each task finds its component. See docs/slurm.md.
"""
