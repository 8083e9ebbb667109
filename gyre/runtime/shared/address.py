"""This rank's advertised address: the one place that decides how other ranks reach it.

Every address a rank hands to another rank is built from `node_address(world)`: the URL of
the engine a cell leader starts (bound to this address; the proxy routes harness calls to
it, the core publishes weights to it, other engines pull migrated KV from it), the
coordinator's control port (`gyre.runtime.shared.wire.connect`) and the snapshot transport's host.

* Every rank in one network namespace of one machine (`gyre run`, `mpiexec` on one host):
  ``127.0.0.1``; nothing leaves the loopback.
* Otherwise: the address of this node's interface that routes to the launch node, the node
  `srun` ran on (Slurm's ``SLURM_LAUNCH_NODE_IPADDR``; without Slurm, the coordinator's host
  name resolved on the coordinator). A UDP ``connect`` asks the kernel's routing table for
  that interface and sends nothing.
* ``GYRE_NODE_ADDRESS`` set in a rank's environment overrides the second case for that rank
  (a cluster whose routed interface is not the one the ranks should use).

"One place" is decided by the network namespace (the inode of ``/proc/self/ns/net``) and the
kernel's boot id, not by the host name: network namespaces and containers on one machine
share a host name but not a loopback. Addresses are IPv4.

    address = node_address(MPI.COMM_WORLD)   # collective, once per rank at start
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

from gyre.errors import ConfigError

LOOPBACK = "127.0.0.1"
OVERRIDE = "GYRE_NODE_ADDRESS"


def namespace_id() -> str:
    """Names this process's network namespace on this boot of this machine: equal for two
    processes exactly when they share a loopback."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the host name is the best there is
        boot = socket.gethostname()
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{boot}/{net}"


def node_address(world: Any, coordinator: int = 0) -> str:
    """Collective over `world`: the address other ranks reach this rank at (module doc)."""
    if len(set(world.allgather(namespace_id()))) == 1:  # every rank takes the same branch
        return LOOPBACK
    anchor = world.bcast(launch_address() if world.Get_rank() == coordinator else None,
                         root=coordinator)  # fmt: skip
    return os.environ.get(OVERRIDE) or route_source(anchor)


def launch_address() -> str:
    """An address of the node the job was launched from, which every node can route to."""
    launch = os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if launch:
        return launch
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    address = socket.gethostbyname(name)
    if ipaddress.ip_address(address).is_loopback:
        raise ConfigError(
            f"the ranks run in different network namespaces, but this node's name {name!r} "
            f"resolves to the loopback address {address}; set {OVERRIDE} on every rank to the "
            "address other nodes reach it at"
        )
    return address


def route_source(destination: str) -> str:
    """This node's address on the interface that routes to `destination` (sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((destination, 9))  # a UDP connect only picks the route and source address
        return str(s.getsockname()[0])
