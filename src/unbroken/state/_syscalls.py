"""Thin ctypes wrappers for the Linux calls the stdlib does not expose.

`fallocate` with modes (punch hole, allocate), `madvise` with populate advice and the
memory-failure probe, and `SO_PEERCRED`. Linux only; every wrapper raises `OSError` with the
kernel's errno.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct
from dataclasses import dataclass

__all__ = [
    "FALLOC_FL_KEEP_SIZE",
    "FALLOC_FL_PUNCH_HOLE",
    "MADV_HWPOISON",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "PeerCredentials",
    "fallocate",
    "madvise_range",
    "memory_failure_supported",
    "peer_credentials",
]

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_HWPOISON = 100
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
EHWPOISON = getattr(errno, "EHWPOISON", 133)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """`fallocate(2)`; unlike `os.posix_fallocate` it never falls back to writing zeros.

    Raises:
        OSError: the kernel refused (errno as returned).
    """
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(
            err, f"fallocate(mode={mode:#x}, off={offset}, len={length}): {os.strerror(err)}"
        )


def madvise_range(address: int, length: int, advice: int) -> int:
    """`madvise(2)` on [address, address + length); returns 0 or the errno (never raises)."""
    if _libc.madvise(address, length, advice) != 0:
        return ctypes.get_errno()
    return 0


def memory_failure_supported() -> bool:
    """Whether this kernel handles poisoned pages (``CONFIG_MEMORY_FAILURE``).

    Non-destructive probe: a zero-length `madvise(MADV_HWPOISON)` is validated (EINVAL when the
    advice is unknown, i.e. memory-failure support is compiled out) and then returns 0 without
    touching any page, because the kernel checks the advice before the length.
    """
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        anchor = ctypes.c_char.from_buffer(probe)
        try:
            return madvise_range(ctypes.addressof(anchor), 0, MADV_HWPOISON) == 0
        finally:
            del anchor
    finally:
        probe.close()


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The `struct ucred` of the process at the other end of a Unix socket."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """Read `SO_PEERCRED` (the credentials the peer had when it connected)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)
