"""A rank's advertised address (gyre.runtime.shared.address) and the engine bound to it.

Same-place is decided by the network namespace, not the host name: a process in a fresh
network namespace (`unshare --net`, root) shares this machine's host name and boot but not
its namespace id. One rank's view of the collective is driven through a small fake world;
the real multi-namespace job is tests/launch/test_slurm_netns.py.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import pytest

from gyre.errors import ConfigError
from gyre.rollout.serving.config import ServerConfig
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.shared.address import LOOPBACK, OVERRIDE, namespace_id, node_address
from gyre.runtime.shared.config import EngineConfig

ID = "python3 -c 'from gyre.runtime.shared.address import namespace_id; print(namespace_id())'"


class OneRankOfTwo:
    """Rank `rank` of a two-rank world whose other rank reports `other` and whose
    coordinator (rank 0) broadcasts `anchor`."""

    def __init__(self, rank: int, other: str, anchor: str | None = None) -> None:
        self.rank, self.other, self.anchor = rank, other, anchor

    def Get_rank(self) -> int:  # mpi4py's name
        return self.rank

    def allgather(self, value: Any) -> list[Any]:
        return [value, self.other] if self.rank == 0 else [self.other, value]

    def bcast(self, value: Any, root: int) -> Any:
        return value if self.rank == root else self.anchor


def test_namespace_id_differs_in_another_network_namespace_on_the_same_host() -> None:
    same = subprocess.run(["sh", "-c", ID], capture_output=True, text=True, check=True)
    other = subprocess.run(["unshare", "--net", "sh", "-c", f"hostname; {ID}"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    name, other_id = other.stdout.split()
    assert same.stdout.strip() == namespace_id()
    assert name == socket.gethostname() and other_id != namespace_id()


def test_one_namespace_stays_on_the_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.213.9.1")  # not consulted
    assert node_address(OneRankOfTwo(1, other=namespace_id())) == LOOPBACK


def test_other_namespaces_use_the_interface_routing_to_the_launch_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(OVERRIDE, raising=False)
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")  # routed over lo: sends nothing
    assert node_address(OneRankOfTwo(0, other="elsewhere")) == "127.0.0.1"
    assert node_address(OneRankOfTwo(1, other="elsewhere", anchor="127.0.0.1")) == "127.0.0.1"
    monkeypatch.setenv(OVERRIDE, "10.213.9.7")
    assert node_address(OneRankOfTwo(1, other="elsewhere", anchor="127.0.0.1")) == "10.213.9.7"


def test_a_node_name_resolving_to_loopback_is_refused_across_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLURM_LAUNCH_NODE_IPADDR", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "localhost")
    with pytest.raises(ConfigError, match=f"set {OVERRIDE}"):
        node_address(OneRankOfTwo(0, other="elsewhere"))


def test_the_engine_binds_and_advertises_the_ranks_address(tmp_path: Any) -> None:
    engine = EngineHost("tiny", EngineConfig(), tmp_path / "e.log", version=0, host="10.213.9.3")
    argv, url = engine.command()
    assert argv[argv.index("--host") + 1] == "10.213.9.3"
    sglang = EngineHost("/m", EngineConfig(backend="sglang"), tmp_path / "s.log", version=0,
                        host="10.213.9.3")  # fmt: skip
    sglang.config.port = 30000  # a fixed port: the URL is known before start
    argv, url = sglang.command()
    assert argv[argv.index("--host") + 1] == "10.213.9.3" and url == "http://10.213.9.3:30000"
    for wildcard in ("0.0.0.0", "", "::"):  # no address to put in a URL
        with pytest.raises(ConfigError, match="host"):
            ServerConfig(model_path="tiny", launch="embedded", host=wildcard)
