"""How an agent reaches its coordinator: the job secret, and a connection retried until the
coordinator listens (a node of a multi-node job may start before node 0 does).

The connection comes from the node's own address when it has one (`--local-addr`), so the
coordinator sees — and logs — which host joined.
"""

from __future__ import annotations

import socket
import time

__all__ = ["RETRY_S", "connect"]

RETRY_S = 0.25
"""Pause between attempts while the coordinator is not listening yet (a back-off of a
connection retry, not a synchronization)."""


def connect(host: str, port: int, timeout_s: float, local_addr: str | None = None) -> socket.socket:
    """A TCP connection to `host:port`, retried for `timeout_s` seconds while refused or
    unreachable.

    Raises:
        OSError: no connection within the timeout (the last error), or `local_addr` cannot be
            bound.
    """
    deadline = time.monotonic() + timeout_s
    source = (local_addr, 0) if local_addr else None
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0, source_address=source)
        except (ConnectionRefusedError, TimeoutError, socket.gaierror, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == 99:  # EADDRNOTAVAIL: a bad local_addr
                raise
            if time.monotonic() >= deadline:
                raise
            time.sleep(RETRY_S)
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
