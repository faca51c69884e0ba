"""The manager rejects foreign peers and malformed requests, and keeps serving."""

from __future__ import annotations

import json
import os
import pwd
import socket
import struct
import subprocess
import sys

import pytest

from unbroken.state import RetainedClient, RetainedStateError

from .conftest import manager_env

PAGE = 64 * 1024


def _frame(obj: object) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _read_reply(sock: socket.socket) -> dict:
    header = sock.recv(4, socket.MSG_WAITALL)
    assert len(header) == 4, "manager closed the connection"
    (length,) = struct.unpack(">I", header)
    return json.loads(sock.recv(length, socket.MSG_WAITALL))


@pytest.fixture
def raw(manager):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(manager[1]))
    yield sock
    sock.close()


BAD_REQUESTS = [
    b"not json",
    b"[1, 2]",
    b"\xff\xfe",
    b"[" * 200_000,  # nesting deep enough to exhaust the JSON parser's recursion
    {"no": "op"},
    {"op": "explode"},
    {"op": "allocate", "name": "model", "nbytes": "lots", "page_bytes": PAGE, "protected": True},
    {"op": "allocate", "name": "model", "nbytes": -1, "page_bytes": PAGE, "protected": True},
    {"op": "allocate", "name": "model", "nbytes": PAGE, "page_bytes": 1000, "protected": True},
    {"op": "allocate", "name": "../etc", "nbytes": PAGE, "page_bytes": PAGE, "protected": True},
    {"op": "allocate", "name": "model", "nbytes": PAGE, "page_bytes": PAGE, "protected": "yes"},
    {"op": "allocate", "name": "model", "nbytes": 1 << 60, "page_bytes": PAGE, "protected": True},
    {"op": "attach", "name": ["model"]},
    {"op": "localize", "names": "model"},
    {"op": "localize", "names": ["absent"]},
    {"op": "remap", "name": "absent", "pages": [0]},
    {"op": "free", "name": None},
]


def test_malformed_requests_get_errors_and_the_connection_survives(raw):
    raw.sendall(
        _frame(
            {
                "op": "allocate",
                "name": "model",
                "nbytes": 4 * PAGE,
                "page_bytes": PAGE,
                "protected": True,
            }
        )
    )
    assert _read_reply(raw)["ok"]  # (its fd arrives too and is dropped with the data)
    bad = [
        *BAD_REQUESTS,
        {"op": "remap", "name": "model", "pages": [4]},
        {"op": "remap", "name": "model", "pages": "all"},
    ]
    for request in bad:
        raw.sendall(_frame(request))
        reply = _read_reply(raw)
        assert reply["ok"] is False and reply["error"], request
    raw.sendall(_frame({"op": "list"}))
    assert [r["name"] for r in _read_reply(raw)["regions"]] == ["model"]


def test_bad_frame_length_drops_only_that_client(manager, raw):
    raw.sendall(struct.pack(">I", 0xFFFFFFFF) + b"x")
    assert _read_reply(raw)["ok"] is False
    assert raw.recv(1) == b""  # dropped: the stream cannot be resynchronized
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(str(manager[1]))
    half.sendall(_frame({"op": "list"})[:3])
    half.close()  # vanishes mid-frame
    with RetainedClient(manager[1]) as client:
        assert client.list() == []
    assert manager[0].poll() is None


def test_stale_socket_is_replaced_and_a_live_one_is_kept(run_dir, spawn_manager):
    path = run_dir / "rmp" / "rank0.sock"
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # left behind by a manager that was SIGKILLed
    stale.close()
    proc, _ = spawn_manager()
    second = subprocess.run(
        [sys.executable, "-m", "unbroken.state.manager", "--socket", str(path)],
        env=manager_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 2 and "another state manager is serving" in second.stderr
    with RetainedClient(path) as client:
        assert client.list() == []
    assert proc.poll() is None


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user to run a foreign-uid client as")
    if os.getuid() != 0:
        pytest.skip("setuid to another uid needs root; the test suite runs unprivileged")
    return entry.pw_uid, entry.pw_gid


FOREIGN = """
import os, socket, sys
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
data = b""  # the manager answers the connection itself, then closes it
while chunk := s.recv(4096):
    data += chunk
print(data[4:].decode() if data else "CLOSED")
"""


def _as_nobody(path, uid: int, gid: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", FOREIGN, str(path), str(uid), str(gid)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.ci_required  # CI runs as root, so it can run a client as another uid
def test_foreign_uid_is_rejected_by_peer_credentials(manager):
    uid, gid = _nobody()
    proc, path = manager
    assert _as_nobody(path, uid, gid) == "EACCES"  # 0600 socket: first line of defence
    os.chmod(path.parent, 0o755)
    os.chmod(path.parent.parent, 0o755)
    os.chmod(path, 0o666)  # open the door, so SO_PEERCRED is what stops the client
    reply = json.loads(_as_nobody(path, uid, gid))
    assert reply["ok"] is False and f"uid {uid}" in reply["error"]
    with RetainedClient(path) as client:  # the manager keeps serving its own uid
        client.allocate("model", PAGE, page_bytes=PAGE, protected=True)
        with pytest.raises(RetainedStateError, match="refused attach"):
            client.attach("nope")
    assert proc.poll() is None
