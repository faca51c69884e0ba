"""Where a single-node job's services listen (docs/security.md, "What listens where").

The services are started as a job starts them (`Coordinator._start_services`: the job store, the
control server, node 0's agent), with the default `Endpoints`; the listening TCP sockets each
process owns are read from /proc (its fds' socket inodes matched against /proc/PID/net/tcp and
tcp6). The control server must listen on loopback only, and the agent on no TCP port at all.

The job store included: torch's TCPStore server, left to itself, listens on every interface
([::] or 0.0.0.0) whatever host it is given; `JobStore.host` binds the socket itself and hands
it over, and this test is what keeps it so.

A frame signed with another key is dropped by the control server without harm: covered in
tests/foundation/test_control.py (`test_wrong_secret_is_rejected` for the channel,
`test_coordinator_rejects_intruders_and_finishes_the_job` against a running job) and, from a
second host, tests/launch/test_multinode.py (`test_a_node_with_another_secret_is_refused_...`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass

import pytest

from unbroken.config import MetricsConfig
from unbroken.launch.coordinator import Coordinator, Endpoints
from unbroken.launch.coordinator.server import ControlServer, Received
from unbroken.messages import Hello, Shutdown
from unbroken.metrics.live import LiveServer

from ..foundation.conftest import tiny_job

WAIT_S = 120.0
_TCP_LISTEN = "0A"
"""The `st` column of a listening socket in /proc/net/tcp."""


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listeners(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket process `pid` holds."""
    own = _socket_inodes(pid)
    out = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == _TCP_LISTEN and inode in own:
                addr, port = local.split(":")
                out[inode] = (str(_address(addr)), int(port, 16))
    return out


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass
class Services:
    coordinator: Coordinator
    opened: dict[str, tuple[str, int]]
    """The TCP listeners the coordinator's process opened to start the job's services."""
    agent: dict[str, tuple[str, int]]
    """The TCP listeners of node 0's agent."""


def _await_hello(server: ControlServer) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for item in server.poll(timeout=0.1):
            if isinstance(item, Received) and isinstance(item.message, Hello):
                return
    pytest.fail(f"node 0's agent did not say hello within {WAIT_S:g} s")


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    coord = Coordinator(
        tiny_job(world_size=1, iterations=2), tmp_path_factory.mktemp("job"), quiet=True
    )
    assert coord.endpoints == Endpoints()  # the default a single-node job runs with
    before = _listeners(os.getpid())
    coord._start_services()
    try:
        opened = {i: a for i, a in _listeners(os.getpid()).items() if i not in before}
        _await_hello(coord.server)  # the agent is up: everything it binds at start is bound
        assert coord.agent_proc is not None
        yield Services(coord, opened, _listeners(coord.agent_proc.pid))
    finally:
        if coord.agent_proc is not None:
            coord.server.send(0, Shutdown())
            coord.agent_proc.wait(timeout=WAIT_S)
        coord.server.close()


def test_the_control_server_listens_on_loopback_only(services):
    server = services.coordinator.server
    mine = [a for a in services.opened.values() if a[1] == server.port]
    assert mine == [("127.0.0.1", server.port)], services.opened


def test_the_agent_listens_on_no_tcp_port(services):
    assert services.agent == {}


def test_the_metrics_server_listens_on_loopback_only():
    before = _listeners(os.getpid())
    live = LiveServer(MetricsConfig().host, 0)  # what run_job starts with --metrics-port 0
    try:
        opened = [a for i, a in _listeners(os.getpid()).items() if i not in before]
    finally:
        live.close()
    assert len(opened) == 1 and _loopback(opened[0][0]), opened


def test_every_tcp_listener_of_a_single_node_job_is_on_loopback(services):
    store_port = services.coordinator.endpoints.store_port
    ports = {port for _, port in services.opened.values()}
    if store_port not in ports or services.coordinator.server.port not in ports:
        pytest.fail(f"not the job's listeners: {services.opened}")  # not the expected failure
    off = [a for a in services.opened.values() if not _loopback(a[0])]
    assert not off, f"listening beyond loopback: {off}"


def test_connections_that_never_say_hello_cannot_pile_up(monkeypatch):
    """A peer without the secret may open connections and send nothing: beyond
    `MAX_STRANGERS` the oldest are closed, and none outlives `HELLO_S`."""
    from unbroken.launch.coordinator import server as srv

    monkeypatch.setattr(srv, "MAX_STRANGERS", 3)
    server = srv.ControlServer("127.0.0.1", b"k" * 32)
    clients = []
    try:
        for _ in range(5):
            clients.append(socket.create_connection(("127.0.0.1", server.port)))
            me = str(clients[-1].getsockname())
            deadline = time.monotonic() + 10
            while me not in [c.peer for c in server._strangers()]:
                assert time.monotonic() < deadline, "the server never accepted"
                server.poll(0.05)
        assert len(server._strangers()) == 3
        for c in clients[:2]:  # the two oldest were closed to make room
            c.settimeout(10)
            assert c.recv(1) == b""
        monkeypatch.setattr(srv, "HELLO_S", 0.0)
        server.poll(0.0)
        assert server._strangers() == []
        for c in clients[2:]:
            c.settimeout(10)
            assert c.recv(1) == b""
    finally:
        for c in clients:
            c.close()
        server.close()
