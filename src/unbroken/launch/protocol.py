"""The authenticated control channel between coordinator and agents.

Frame: 4-byte big-endian length L, then L bytes = 32-byte HMAC-SHA256 tag (keyed by the
per-job secret) followed by a UTF-8 JSON object: one `unbroken.messages` message in its wire
form plus an increasing sequence number `seq`. Every frame is checked before anyone reads it:
oversize, bad tag, bad JSON, an op this side does not accept, a field missing, unknown or of the
wrong type (`unbroken.messages.decode`), or a non-increasing sequence number raise
`ProtocolError` with the reason. What comes out of `feed` is a typed, validated message. The
receiver logs the reason and drops that connection; it never crashes.

Hand-written because it is ~100 lines over `hmac` and `socket`, and the transports torch offers
(TCPStore) have no authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct

from unbroken.messages import (
    Hello,
    MemoryReport,
    Message,
    MessageError,
    NodeBeat,
    RankExited,
    RankHung,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
    Stopped,
    encode,
)
from unbroken.messages import decode as decode_message

__all__ = [
    "FROM_AGENT",
    "FROM_COORDINATOR",
    "Channel",
    "ProtocolError",
]

MAX_FRAME = 1 << 20
_TAG = 32

FROM_AGENT: tuple[type[Message], ...] = (
    Hello,
    NodeBeat,
    Started,
    RankExited,
    RankHung,
    Stopped,
    MemoryReport,
)
"""What a coordinator accepts from an agent."""
FROM_COORDINATOR: tuple[type[Message], ...] = (StartGeneration, StopGeneration, Shutdown)
"""What an agent accepts from the coordinator."""


class ProtocolError(Exception):
    """A frame that must be rejected (the message says why)."""


class Channel:
    """One authenticated, sequenced, framed connection.

    Args:
        sock: a connected stream socket.
        secret: the per-job secret (bytes).
        accept: the message types this side accepts from the peer.
    """

    def __init__(
        self, sock: socket.socket, secret: bytes, accept: tuple[type[Message], ...]
    ) -> None:
        self.sock = sock
        self.secret = secret
        self.accept = accept
        self._send_seq = 0
        self._recv_seq = -1
        self._buf = b""
        self._pending: list[Message] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Message) -> None:
        self._send_seq += 1
        body = json.dumps({**encode(msg), "seq": self._send_seq}).encode()
        tag = hmac.new(self.secret, body, hashlib.sha256).digest()
        self.sock.sendall(struct.pack(">I", len(body) + _TAG) + tag + body)

    def feed(self, data: bytes) -> list[Message]:
        """Add received bytes; return the complete, verified messages.

        Raises:
            ProtocolError: the stream holds a frame that fails a check.
        """
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            (length,) = struct.unpack(">I", self._buf[:4])
            if length > MAX_FRAME or length < _TAG + 2:
                raise ProtocolError(f"bad frame length {length}")
            if len(self._buf) < 4 + length:
                break
            frame, self._buf = self._buf[4 : 4 + length], self._buf[4 + length :]
            out.append(self._verify(frame))
        return out

    def _verify(self, frame: bytes) -> Message:
        tag, body = frame[:_TAG], frame[_TAG:]
        want = hmac.new(self.secret, body, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, want):
            raise ProtocolError("authentication failed (bad HMAC tag)")
        try:
            obj = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ProtocolError("malformed message (not JSON)") from None
        seq = obj.get("seq") if isinstance(obj, dict) else None
        try:
            msg = decode_message(obj, self.accept)
        except MessageError as exc:
            raise ProtocolError(str(exc)) from None
        if not isinstance(seq, int) or seq <= self._recv_seq:
            raise ProtocolError(f"bad sequence number {seq!r} (replay?)")
        self._recv_seq = seq
        return msg

    def take_pending(self) -> list[Message]:
        """Messages already received by `recv_blocking` but not yet returned."""
        out, self._pending = self._pending, []
        return out

    def recv_blocking(self, timeout: float | None = None) -> Message:
        """Block until one message arrives (others stay queued for the next call).

        Raises:
            ProtocolError: bad frame. ConnectionError: peer closed. TimeoutError.
        """
        self.sock.settimeout(timeout)
        try:
            while not self._pending:
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionError("peer closed the control connection")
                self._pending.extend(self.feed(data))
            return self._pending.pop(0)
        finally:
            self.sock.settimeout(None)
