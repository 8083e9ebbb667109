"""The control channel between the coordinator, the proxy node and the cells.

Messages are the frozen dataclasses of `gyre.runtime.shared.messages`, pickled and framed over
one TCP connection per rank to the coordinator (`connect`, collective over the MPI world
once at start). Why not MPI for control: a blocking MPI receive busy-polls a core in
MPICH, and polling with sleeps still wakes every rank dozens of times a second; a socket
lets a waiting rank block in `select` at no cost, while MPI keeps what it is good at (the
gradient reduce, the parameter broadcast, the snapshot window). TCP keeps each rank's
messages in order, which the protocol relies on (a proxy's `HarnessEnded` always precedes
its `Assessed`), and a dead peer is seen at once: its connection closes.

The coordinator listens; every other rank connects and proves it belongs to the job with a
token the coordinator broadcast over MPI (pickles are only ever read from the job's own
ranks). The coordinator listens on its advertised address (`gyre.runtime.shared.address`:
127.0.0.1 when every rank shares one network namespace, else its node's address).

    link = connect(MPI.COMM_WORLD, node_address(MPI.COMM_WORLD))   # every rank, once
    link.send(messages.Stop(0), dest=3)     # coordinator -> rank 3
    m = link.recv(timeout=1.0)              # the next message, or None
"""

from __future__ import annotations

import contextlib
import pickle
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

from gyre.errors import GyreError
from gyre.runtime.shared.messages import Message

_FRAME = struct.Struct("<Q")
_HELLO = struct.Struct("<16si")  # token, rank
ABORT_GRACE_S = 0.5  # seconds between the last error line and MPI_Abort (abort_world)


class RuntimeFailure(GyreError):
    """The run cannot continue (a component failed, a wait ran past its deadline)."""


class PeerLost(RuntimeFailure):
    """A rank's control connection closed: the process died (or left before it should)."""


class Link:
    """One rank's end of the control channel (the coordinator holds one per peer)."""

    def __init__(self, rank: int, peers: dict[int, socket.socket]) -> None:
        self.rank = rank
        self.peers = peers
        self._locks = {r: threading.Lock() for r in peers}
        self._selector = selectors.DefaultSelector()
        self._ready: list[selectors.SelectorKey] = []  # served in turn: no peer starves
        for r, sock in peers.items():
            self._selector.register(sock, selectors.EVENT_READ, r)

    def send(self, msg: Message, dest: int) -> None:
        """Send one message to world rank `dest` (thread-safe; whole frames only)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        sock = self.peers.get(dest)
        if sock is None:
            raise RuntimeFailure(f"rank {self.rank} has no control connection to rank {dest}")
        with self._locks[dest]:
            try:
                sock.sendall(_FRAME.pack(len(data)) + data)
            except OSError as e:
                raise PeerLost(f"rank {dest} is gone ({e})") from None

    def recv(self, timeout: float) -> Message | None:
        """The next message from any peer, or None after `timeout` seconds (blocks, no CPU)."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            self._ready = [key for key, _ in self._selector.select(deadline - time.monotonic())]
            if not self._ready and time.monotonic() >= deadline:
                return None
        key = self._ready.pop(0)
        return self._read(key.fileobj, key.data)  # type: ignore[arg-type]

    def _read(self, sock: socket.socket, rank: int) -> Message:
        head = _exact(sock, _FRAME.size)
        if head is None:
            self._selector.unregister(sock)
            raise PeerLost(f"rank {rank} closed its control connection: the process died")
        body = _exact(sock, _FRAME.unpack(head)[0])
        if body is None:
            raise PeerLost(f"rank {rank} died in the middle of a message")
        msg = pickle.loads(body)
        if not isinstance(msg, Message):
            raise RuntimeFailure(f"rank {rank} sent {type(msg).__name__}, not a message")
        return msg

    def close(self) -> None:
        for sock in self.peers.values():
            with contextlib.suppress(KeyError, ValueError):  # unregistered at its EOF
                self._selector.unregister(sock)
            sock.close()
        self._selector.close()


def _exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly n bytes, or None at end of stream."""
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def connect(world: Any, address: str, coordinator: int = 0, timeout: float = 120.0) -> Link:
    """Collective over `world`: the coordinator's link to every rank, each rank's to it.
    `address`: this rank's advertised address (`gyre.runtime.shared.address.node_address`); the
    coordinator listens on its own."""
    rank, size = world.Get_rank(), world.Get_size()
    if rank == coordinator:
        server = socket.create_server((address, 0))
        server.settimeout(timeout)
        token = secrets.token_bytes(16)
        world.bcast((address, server.getsockname()[1], token), root=coordinator)
        # a netmod without asynchronous progress (MPICH's OFI over tcp) may still hold the
        # broadcast in this rank's queue; the barrier delivers it before accept() blocks
        world.Barrier()
        peers: dict[int, socket.socket] = {}
        while len(peers) < size - 1:
            sock, _ = server.accept()
            sock.settimeout(None)
            hello = _exact(sock, _HELLO.size)
            if hello is None or _HELLO.unpack(hello)[0] != token:
                sock.close()  # not one of ours
                continue
            peers[_HELLO.unpack(hello)[1]] = _tuned(sock)
        server.close()
        return Link(rank, peers)
    host, port, token = world.bcast(None, root=coordinator)
    world.Barrier()
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    sock.sendall(_HELLO.pack(token, rank))
    return Link(rank, {coordinator: _tuned(sock)})


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages, at once
    return sock


def abort_world(rank: int, component: str, error: BaseException) -> None:
    """Print one clear line (and the traceback for non-Gyre errors), then abort every rank."""
    from mpi4py import MPI

    if not isinstance(error, GyreError):
        traceback.print_exception(error, file=sys.stderr)
    print(f"gyre run: error on rank {rank} ({component}): {error}", file=sys.stderr, flush=True)
    # MPI_Abort tears the world down at once: a line still in the pipe to the launcher's
    # output forwarder is lost (a CI job log ended without the coordinator's reason). Give
    # the forwarder a moment to read it first.
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)
