"""A cell's ranks: the leader serves rollout through its engine host or trains (`leader`),
the other ranks train their share (`follower`); all of them run one training protocol
(`trainer`) over their replica of the policy, paced to a modelled cluster where asked
(`pace`), and a colocated trainer's state leaves the GPU between phases (`residency`).
"""
