"""The control channel: authentication, malformed frames, replay; the coordinator survives."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from unbroken.api import run_job
from unbroken.launch.protocol import FROM_AGENT, FROM_COORDINATOR, Channel, ProtocolError
from unbroken.messages import Hello, RankExited, Shutdown
from unbroken.metrics.log import read_jsonl

from .conftest import tiny_job


def _pair(secret=b"k" * 32):
    a, b = socket.socketpair()
    return Channel(a, secret, FROM_AGENT), Channel(b, secret, FROM_AGENT), b


def test_authenticated_messages_round_trip_as_typed_values():
    tx, rx, sock_b = _pair()
    sent = [Hello(node=0, pid=7), RankExited(rank=1, generation=0, returncode=-9, t=1.0)]
    for msg in sent:
        tx.send(msg)
    assert rx.feed(sock_b.recv(65536)) == sent


def test_wrong_secret_is_rejected():
    a, b = socket.socketpair()
    Channel(a, b"x" * 32, FROM_AGENT).send(Hello(node=0, pid=1))
    with pytest.raises(ProtocolError, match="authentication"):
        Channel(b, b"y" * 32, FROM_AGENT).feed(b.recv(65536))


def test_each_side_accepts_only_what_its_peer_may_send():
    a, b = socket.socketpair()
    Channel(a, b"k" * 32, FROM_AGENT).send(Hello(node=0, pid=1))  # an agent's op, to an agent
    with pytest.raises(ProtocolError, match="unknown op 'hello'"):
        Channel(b, b"k" * 32, FROM_COORDINATOR).feed(b.recv(65536))
    Channel(b, b"k" * 32, FROM_AGENT).send(Shutdown())
    assert Channel(a, b"k" * 32, FROM_COORDINATOR).feed(a.recv(65536)) == [Shutdown()]


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (struct.pack(">I", 1 << 30), "bad frame length"),
        (struct.pack(">I", 3) + b"abc", "bad frame length"),
    ],
)
def test_malformed_frames_are_rejected(frame, reason):
    _, rx, _ = _pair()
    with pytest.raises(ProtocolError, match=reason):
        rx.feed(frame)


def test_authenticated_but_malformed_or_replayed_is_rejected():
    import hashlib
    import hmac

    secret = b"s" * 32

    def frame(body: bytes) -> bytes:
        tag = hmac.new(secret, body, hashlib.sha256).digest()
        return struct.pack(">I", len(tag) + len(body)) + tag + body

    for body, reason in [
        (b"not json", "not JSON"),
        (b'{"seq": 1}', "no 'op'"),
        (b'{"op": "format_disk", "seq": 1}', "unknown op"),
        (b'{"op": "stop", "seq": 1, "generation": 0}', "unknown op"),  # not from an agent
        (b'{"op": "hello", "seq": "x", "node": 0, "pid": 1}', "sequence"),
        (b'{"op": "hello", "seq": 1, "pid": 1}', "missing field 'node'"),
        (b'{"op": "hello", "seq": 1, "node": "0", "pid": 1}', "hello.node: expected int"),
        (b'{"op": "hello", "seq": 1, "node": 0, "pid": 1, "root": true}', "unknown field"),
        (b'{"op": "memory", "seq": 1, "event": "rm -rf", "t": 1.0}', "unknown event"),
    ]:
        _, rx, _ = _pair(secret)
        with pytest.raises(ProtocolError, match=reason):
            rx.feed(frame(body))
    _, rx, _ = _pair(secret)
    rx.feed(frame(b'{"op": "hello", "seq": 5, "node": 0, "pid": 1}'))
    with pytest.raises(ProtocolError, match="replay"):
        rx.feed(frame(b'{"op": "hello", "seq": 5, "node": 0, "pid": 1}'))


def test_coordinator_rejects_intruders_and_finishes_the_job(tmp_path):
    cfg = tiny_job(iterations=12)
    result = {}
    job = threading.Thread(
        target=lambda: result.update(run_job(cfg, tmp_path, quiet=True)), daemon=True
    )
    job.start()
    info = tmp_path / "coordinator-train.json"
    deadline = time.time() + 60
    while not info.exists() and time.time() < deadline:
        time.sleep(0.01)  # polling for the file the coordinator writes, not a sync by sleep
    port = json.loads(info.read_text())["port"]
    attacks = [
        b"GET / HTTP/1.0\r\n\r\n",  # garbage: frame length is nonsense
        struct.pack(">I", 40) + b"\0" * 32 + b'{"op":"stop"}',  # bad HMAC
        struct.pack(">I", 10) + b"0123456789",  # too short for a tag
    ]
    for payload in attacks:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(payload)
            s.settimeout(30)
            assert s.recv(1) == b""  # the coordinator drops the connection
    job.join(timeout=240)
    assert not job.is_alive()
    assert result["state"] == "done"
    rejected = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "control_rejected"]
    reasons = " ".join(e["reason"] for e in rejected)
    assert len(rejected) == 3
    assert "bad frame length" in reasons and "authentication failed" in reasons


def test_jsonl_tail_reads_only_new_complete_lines(tmp_path):
    from unbroken.metrics.log import JsonlLog, JsonlTail

    path = tmp_path / "x.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []
    log = JsonlLog(path)
    log.write({"a": 1})
    with path.open("a") as fh:
        fh.write('{"b": ')  # a torn line is left for later
    assert tail.read_new() == [{"a": 1}]
    with path.open("a") as fh:
        fh.write("2}\n")
    assert tail.read_new() == [{"b": 2}]
    assert tail.read_new() == []
