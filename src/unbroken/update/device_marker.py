"""Progress-marker writes made by the CUDA stream, ordered with the work they record (Leto §5.2:
the marker is written by the device, after the kernels before it on the stream).

A host write of the marker (`ProgressMarker.write`) happens when the host *enqueues* the
chunk's kernels, not when the GPU has run them: a crash between the two leaves a marker that
claims an undo copy or a commit the device never executed. Here the marker's slot is written by
a kernel on the same stream as the transaction's other kernels, into the marker region (host
memory the state manager owns, registered with CUDA so the device can store to it). Stream
order makes every kernel before the write complete before the write starts.

One launch writes one slot in all three marker pages (the marker and its two protection copies,
`MarkerReplicas`): the 80-byte body first, then — after a system-scope memory barrier in every
thread and a barrier across the block — the CRC-32 field. A crash inside the launch therefore
leaves a slot whose CRC does not match its body, which `ProgressMarker.read` ignores (it takes
the other slot: the previous write), exactly as for a torn host write. The bytes are those of
`ProgressMarker.write`: the same layout, the same zlib CRC-32.

[Note: CRC in the kernel] CRC-32 of a fixed-length message is affine over GF(2): with z the CRC
of 80 zero bytes and T[i][b] = crc32(b at position i, zeros elsewhere) ^ z, crc32(m) = z ^
XOR_i T[i][m_i]. The kernel gathers 80 table entries (80 x 256 x 8 bytes on the device) and
XOR-reduces them: one load per byte, no serial bit loop. Hand-written because no library writes
a CRC-stamped record from a GPU stream into host memory.
"""

from __future__ import annotations

import struct
import zlib
from functools import cache

import numpy as np
import torch

from unbroken.update.host_pin import DevicePointer, HostRegistration
from unbroken.update.layout import MARKER_PAGE
from unbroken.update.marker import SLOT_BYTES, MarkerState

__all__ = ["DeviceMarker"]

_BODY_BYTES = 80
_WORDS = struct.Struct("<qqqqqqdddd")
_AS_INT = struct.Struct("<qqqqqqqqqq")


@cache
def _crc_tables() -> tuple[np.ndarray, int]:
    """(T[80, 256] as int64, z): see [Note: CRC in the kernel]."""
    zero = bytes(_BODY_BYTES)
    z = zlib.crc32(zero)
    table = np.zeros((_BODY_BYTES, 256), dtype=np.int64)
    msg = bytearray(_BODY_BYTES)
    for i in range(_BODY_BYTES):
        for b in range(256):
            msg[i] = b
            table[i, b] = zlib.crc32(msg) ^ z
        msg[i] = 0
    return table, z


def crc_of(body: bytes) -> int:
    """The CRC the kernel computes, on the host (equal to zlib.crc32; a test holds it)."""
    table, z = _crc_tables()
    out = z
    for i, b in enumerate(body):
        out ^= int(table[i, b])
    return out


@cache
def _kernels():
    """(marker_write, marker_write_dev) from `_triton_marker` (imports Triton: CUDA only)."""
    from unbroken.update import _triton_marker as k

    return k.marker_write, k.marker_write_dev


def _words(state: MarkerState) -> tuple[int, ...]:
    """The marker body's ten 8-byte fields as int64 values (floats by their bit patterns)."""
    return _AS_INT.unpack(
        _WORDS.pack(
            state.seq,
            state.iteration,
            int(state.stage),
            state.group,
            state.chunk,
            state.done_iter,
            state.loss,
            state.grad_norm,
            state.grad_scale,
            state.lr,
        )
    )


class DeviceMarker:
    """Enqueues marker writes on the current stream of `device`. The pages stay registered
    with CUDA while the marker lives (or until `reregister`), and no longer.

    Args:
        pages: the marker region's three pages, a uint8 host tensor [3, MARKER_PAGE].
        device: the CUDA device whose stream carries the transaction.
    """

    def __init__(self, pages: torch.Tensor, device: torch.device) -> None:
        if pages.device.type != "cpu" or pages.dtype != torch.uint8 or pages.dim() != 2:
            raise ValueError("the device marker writes a uint8 host tensor of 3 pages")
        self.pages = pages
        self.device = device
        table, z = _crc_tables()
        self._table = torch.from_numpy(table).to(device)
        self._crc0 = z
        self._pin = HostRegistration(pages, device)

    def write(self, state: MarkerState) -> None:
        """Enqueue the write of `state` into slot `state.seq % 2` of every marker page."""
        self._pin.ensure()
        words = _words(state)
        with torch.cuda.device(self.device):
            _kernels()[0][(1,)](
                DevicePointer(self.pages.data_ptr()),
                self._table,
                (state.seq % 2) * SLOT_BYTES,
                self._crc0,
                *words,
                PAGE=MARKER_PAGE,
                num_warps=4,
            )

    @staticmethod
    def base_words(state: MarkerState) -> list[int]:
        """The device block `write_at` reads, for the transactions that follow `state`: its
        sequence number, iteration, done_iter and the four float fields as int64 bit patterns."""
        words = _words(state)
        return [words[0], words[1], words[5], *words[6:]]

    def write_at(
        self, base: torch.Tensor, *, seq_off: int, stage: int, group: int, chunk: int, idle: bool
    ) -> None:
        """Enqueue the write of the state `seq_off` writes after the one `base` describes
        (`base_words`, an int64 device tensor), with this stage and position; `idle` takes
        done_iter from the iteration (the update's last commit). Every argument but `base` is
        fixed at enqueue, so a CUDA graph can capture the write and replay it each iteration
        with a new `base`."""
        self._pin.ensure()
        with torch.cuda.device(self.device):
            _kernels()[1][(1,)](
                DevicePointer(self.pages.data_ptr()),
                self._table,
                base,
                self._crc0,
                seq_off,
                stage,
                group,
                chunk,
                int(idle),
                PAGE=MARKER_PAGE,
                num_warps=4,
            )

    def reregister(self) -> None:
        """Register the pages again (after the manager remapped them)."""
        self._pin.reregister()
