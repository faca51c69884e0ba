"""The coordinator's control server: accepts node agents on an authenticated TCP channel,
turns their frames into typed messages (`unbroken.launch.protocol.Channel` validates every one),
and sends them commands.

It owns sockets and nothing else: no recovery decision is taken here. A connection that sends a
bad frame is dropped with its reason (`Dropped`); a node whose connection drops is reported
the same way, and the coordinator's core decides what that means.
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any

from unbroken.launch.protocol import FROM_AGENT, Channel, ProtocolError
from unbroken.messages import Hello, Message

__all__ = ["ControlServer", "Dropped", "Received"]


@dataclass(frozen=True, slots=True)
class Received:
    node: int | None
    """The node the connection said hello as (None before its hello)."""
    message: Message


@dataclass(frozen=True, slots=True)
class Dropped:
    node: int | None
    peer: str
    reason: str
    closed: bool = False
    """The peer closed the connection (nothing it sent was refused)."""


HELLO_S = 10.0
"""How long a connection may stay without introducing itself (an agent says hello at once)."""

MAX_STRANGERS = 64
"""Connections without a hello kept at once; beyond, the oldest is closed (a peer without the
secret cannot exhaust the coordinator's file descriptors)."""


class _Conn:
    def __init__(self, sock: socket.socket, peer: Any, secret: bytes) -> None:
        self.channel = Channel(sock, secret, FROM_AGENT)
        self.peer = str(peer)
        self.node: int | None = None
        self.t_accept = time.monotonic()


class ControlServer:
    """Args: host (the address to bind), secret (the job's HMAC key), port (0: any free one).

    Raises:
        OSError: the port is taken (the caller names it to the user)."""

    def __init__(self, host: str, secret: bytes, port: int = 0) -> None:
        self.secret = secret
        self.sel = selectors.DefaultSelector()
        self.listener = socket.create_server((host, port))
        self.listener.setblocking(False)
        self.host, self.port = self.listener.getsockname()[:2]
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self._nodes: dict[int, _Conn] = {}

    @property
    def nodes(self) -> frozenset[int]:
        """Nodes with a live, introduced connection."""
        return frozenset(self._nodes)

    def send(self, node: int, msg: Message) -> None:
        """Send `msg` to `node` (a node whose connection is gone is silently skipped: its loss
        is reported through `poll`)."""
        conn = self._nodes.get(node)
        if conn is not None:
            conn.channel.send(msg)

    def poll(self, timeout: float) -> list[Received | Dropped]:
        """What arrived within `timeout` seconds, in order."""
        out: list[Received | Dropped] = []
        for key, _ in self.sel.select(timeout=timeout):
            if key.data is None:
                self._accept()
            else:
                out += self._read(key.data)
        self._close_strangers()
        return out

    def _strangers(self) -> list[_Conn]:
        conns = [k.data for k in self.sel.get_map().values() if k.data is not None]
        return sorted((c for c in conns if c.node is None), key=lambda c: c.t_accept)

    def _close_strangers(self) -> None:
        """Close connections that did not say hello in time, and the oldest beyond the cap."""
        strangers = self._strangers()
        now = time.monotonic()
        for i, conn in enumerate(strangers):
            if now - conn.t_accept > HELLO_S or len(strangers) - i > MAX_STRANGERS:
                self._close(conn)

    def disconnect(self, node: int) -> None:
        """Close `node`'s connection (a lost or fenced node); nothing if it has none."""
        conn = self._nodes.get(node)
        if conn is not None:
            self._close(conn)

    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except BlockingIOError:
            return
        except OSError:  # out of file descriptors (EMFILE, ENFILE), a connection reset first
            strangers = self._strangers()
            if strangers:  # make room: the oldest connection that never introduced itself
                self._close(strangers[0])
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sel.register(sock, selectors.EVENT_READ, _Conn(sock, peer, self.secret))

    def _close(self, conn: _Conn) -> None:
        self.sel.unregister(conn.channel.sock)
        conn.channel.sock.close()
        if conn.node is not None and self._nodes.get(conn.node) is conn:
            del self._nodes[conn.node]

    def _drop(self, conn: _Conn, reason: str, closed: bool = False) -> Dropped:
        self._close(conn)
        return Dropped(conn.node, conn.peer, reason, closed)

    def _read(self, conn: _Conn) -> list[Received | Dropped]:
        try:
            data = conn.channel.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            return [self._drop(conn, f"connection error: {exc}")]
        if not data:
            if conn.node is None:
                self._close(conn)  # a peer that never introduced itself left: nothing lost
                return []
            return [self._drop(conn, "agent connection closed", closed=True)]
        out: list[Received | Dropped] = []
        try:
            for msg in conn.channel.feed(data):
                if isinstance(msg, Hello):
                    self._introduce(conn, msg)
                elif conn.node is None:
                    raise ProtocolError(f"{msg.OP!r} before hello")
                out.append(Received(conn.node, msg))
        except ProtocolError as exc:
            out.append(self._drop(conn, str(exc)))
        return out

    def _introduce(self, conn: _Conn, hello: Hello) -> None:
        if conn.node is not None:
            raise ProtocolError("a second hello on one connection")
        if hello.node in self._nodes:
            raise ProtocolError(f"a second agent for node {hello.node}")
        conn.node = hello.node
        self._nodes[hello.node] = conn

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
        self._nodes.clear()
