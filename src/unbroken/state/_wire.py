"""Framing of the state-manager protocol.

Frame: 4-byte big-endian length L, then L bytes of a UTF-8 JSON object. Requests carry
``{"op": str, ...}``; replies carry ``{"ok": true, ...}`` or ``{"ok": false, "error": str}``. A
reply that hands over a region is sent with its fds as `SCM_RIGHTS` ancillary data on the
frame's own bytes, so the fds that arrive while a reply frame is read belong to that reply (the
client has one request in flight at a time). The kernel passes at most 253 fds per message
(SCM_MAX_FD), and a GPU region has one fd per page: a reply with more fds is sent as several
pieces of its frame, each carrying up to `FDS_PER_MESSAGE` of them, in order.

No authentication tag (unlike `unbroken.launch.protocol`): the socket is 0600 in a private run
directory and the manager checks `SO_PEERCRED` on every connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from typing import Any

__all__ = [
    "FDS_PER_MESSAGE",
    "MAX_FRAME",
    "FrameError",
    "FrameReader",
    "encode",
    "recv_reply",
    "send_frame",
]

MAX_FRAME = 1 << 20
_HEADER = struct.Struct(">I")
FDS_PER_MESSAGE = 250


class FrameError(Exception):
    """A frame that cannot be parsed (the message says why)."""


def encode(message: dict[str, Any]) -> bytes:
    """Serialize one message into a frame."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one frame with `fds` attached (SCM_RIGHTS): up to `FDS_PER_MESSAGE` on each of
    the frame's first bytes, one byte per message, then the rest of the frame."""
    frame = encode(message)
    fds = list(fds or ())
    batches = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)]
    if len(batches) > len(frame):
        raise FrameError(f"{len(fds)} fds do not fit on a frame of {len(frame)} bytes")
    pos = 0
    for batch in batches:
        # A byte that carries fds goes alone: the receiver's read stops at it.
        last = pos + 1 if len(batches) > 1 else len(frame)
        sent = socket.send_fds(sock, [frame[pos:last]], batch)
        pos += sent
    sock.sendall(frame[pos:])


class FrameReader:
    """Incremental parser: feed bytes, get whole frames.

    A bad length is unrecoverable (the stream cannot be resynchronized) and raises
    `FrameError` from `feed`; a frame whose body is not a JSON object is returned as a
    `FrameError` instance so the caller can answer it and keep the connection.
    """

    def __init__(self) -> None:
        self._buf = b""

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any] | FrameError]:
        """Add received bytes; return the complete frames, decoded or as errors.

        Raises:
            FrameError: a length prefix outside 2..MAX_FRAME.
        """
        self._buf += data
        out: list[dict[str, Any] | FrameError] = []
        while len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            if length < 2 or length > MAX_FRAME:
                raise FrameError(f"bad frame length {length}")
            if len(self._buf) < _HEADER.size + length:
                break
            body = self._buf[_HEADER.size : _HEADER.size + length]
            self._buf = self._buf[_HEADER.size + length :]
            out.append(_decode(body))
        return out


def _decode(body: bytes) -> dict[str, Any] | FrameError:
    try:
        message = json.loads(body.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return FrameError(f"frame is not JSON: {exc}")
    if not isinstance(message, dict):
        return FrameError("frame is not a JSON object")
    return message


def recv_reply(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Read exactly one reply frame and the fds that came with it (blocking, socket timeout).

    Raises:
        FrameError: the manager closed the connection or sent a malformed frame.
    """
    reader = FrameReader()
    fds: list[int] = []
    try:
        while True:
            data, got, flags, _addr = socket.recv_fds(sock, 65536, FDS_PER_MESSAGE + 3)
            if flags & socket.MSG_CTRUNC:
                fds.extend(got)
                raise FrameError("file descriptors were truncated (over the receive limit)")
            fds.extend(got)
            for fd in got:  # SCM_RIGHTS fds arrive inheritable; keep them out of exec'd children
                os.set_inheritable(fd, False)
            if not data:
                raise FrameError("state manager closed the connection")
            frames = reader.feed(data)
            if frames:
                if len(frames) > 1 or reader.pending:
                    raise FrameError("state manager sent more than one reply")
                frame = frames[0]
                if isinstance(frame, FrameError):
                    raise frame
                return frame, fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
