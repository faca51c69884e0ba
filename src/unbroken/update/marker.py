"""The progress marker: a tiny retained record of how far the update phase has come.

Two slots of 128 bytes; a write goes to the slot after the current one and carries an
increasing sequence number and a CRC-32 of the slot, written last. A write torn by a crash
leaves a slot whose CRC does not match; `read` returns the valid slot with the highest sequence
number, i.e. the last completed write. Each write is made after the operation it records has
completed (see `Stage`).
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = ["MARKER_BYTES", "MarkerReplicas", "MarkerState", "ProgressMarker", "Stage"]

SLOT_BYTES = 128
MARKER_BYTES = 2 * SLOT_BYTES

_DTYPE = np.dtype(
    [
        ("seq", "<i8"),
        ("iteration", "<i8"),
        ("stage", "<i8"),
        ("group", "<i8"),
        ("chunk", "<i8"),
        ("done_iter", "<i8"),
        ("loss", "<f8"),
        ("grad_norm", "<f8"),
        ("grad_scale", "<f8"),
        ("lr", "<f8"),
        ("crc", "<u8"),
    ]
)
_CRC_SPAN = _DTYPE.itemsize - 8
_BODY = struct.Struct("<qqqqqqdddd")  # the fields of _DTYPE before the crc, same layout
_CRC = struct.Struct("<Q")
assert _BODY.size == _CRC_SPAN


class Stage(enum.IntEnum):
    IDLE = 0
    """The update of `done_iter` is complete; nothing of the next iteration is retained."""
    GRADS_PROTECTED = 1
    """Gradients of `iteration` and their parity (both tiers) are complete."""
    SYNCED = 2
    """Statistics of `iteration` agreed; chunks before (group, chunk) are committed."""
    CHUNK_UPDATING = 3
    """The undo buffer holds chunk (group, chunk)'s pre-update bytes; data may be torn."""
    PARITY_READY = 4
    """Chunk updated; the scratch buffers hold its new parity (both tiers) for the range."""


@dataclass(frozen=True, slots=True)
class MarkerState:
    seq: int = 0
    iteration: int = 0
    stage: Stage = Stage.IDLE
    group: int = 0
    chunk: int = 0
    done_iter: int = -1
    loss: float = 0.0
    grad_norm: float = 0.0
    grad_scale: float = 1.0
    lr: float = 0.0

    @property
    def next_iteration(self) -> int:
        return self.done_iter + 1


class ProgressMarker:
    """Reads and writes the marker in a retained uint8 buffer of `MARKER_BYTES`."""

    def __init__(self, buffer: torch.Tensor) -> None:
        if buffer.numel() < MARKER_BYTES or buffer.dtype != torch.uint8:
            raise ValueError(f"marker needs a uint8 buffer of {MARKER_BYTES} bytes")
        raw = buffer[:MARKER_BYTES].numpy()
        self._slots = [raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES] for i in range(2)]
        self._state: MarkerState | None = None

    def _decode(self, slot: np.ndarray) -> MarkerState | None:
        rec = slot[: _DTYPE.itemsize].view(_DTYPE)[0]
        if int(rec["crc"]) != zlib.crc32(slot[:_CRC_SPAN].tobytes()) or int(rec["seq"]) <= 0:
            return None
        return MarkerState(
            seq=int(rec["seq"]),
            iteration=int(rec["iteration"]),
            stage=Stage(int(rec["stage"])),
            group=int(rec["group"]),
            chunk=int(rec["chunk"]),
            done_iter=int(rec["done_iter"]),
            loss=float(rec["loss"]),
            grad_norm=float(rec["grad_norm"]),
            grad_scale=float(rec["grad_scale"]),
            lr=float(rec["lr"]),
        )

    def read(self) -> MarkerState | None:
        """The last completed write, or None if neither slot is valid — which a crash cannot
        cause once a write has completed (the next write goes to the other slot): None means
        the first write never completed."""
        states = [s for s in map(self._decode, self._slots) if s is not None]
        self._state = max(states, key=lambda s: s.seq) if states else None
        return self._state

    @property
    def state(self) -> MarkerState:
        if self._state is None:
            raise RuntimeError("marker not initialized")
        return self._state

    @property
    def last_slot(self) -> tuple[int, int]:
        """(offset, length) of the slot the last write went to (its protection copies it)."""
        seq = self._state.seq if self._state is not None else 0
        return (seq % 2) * SLOT_BYTES, SLOT_BYTES

    def advance(self, **changes) -> MarkerState:
        """The next state (fields not given keep their values), taken as the current one
        without storing it: for a writer that stores it itself (the CUDA stream,
        `unbroken.update.device_marker`)."""
        base = self._state or MarkerState()
        self._state = replace(base, seq=base.seq + 1, **changes)
        return self._state

    def skip(self, writes: int, **changes) -> MarkerState:
        """The state `writes` writes later, the last of them with `changes`, taken as the
        current one without storing it: for a writer that made those writes itself (a CUDA
        graph's replay, `unbroken.update.graph`)."""
        if writes < 1:
            raise ValueError(f"skip needs at least one write, got {writes}")
        base = self._state or MarkerState()
        self._state = replace(base, seq=base.seq + writes, **changes)
        return self._state

    def write(self, **changes) -> MarkerState:
        """Record a new state (fields not given keep their values): the body, then its CRC."""
        new = self.advance(**changes)
        slot = self._slots[new.seq % 2]
        body = _BODY.pack(
            new.seq,
            new.iteration,
            int(new.stage),
            new.group,
            new.chunk,
            new.done_iter,
            new.loss,
            new.grad_norm,
            new.grad_scale,
            new.lr,
        )
        slot[:_CRC_SPAN] = np.frombuffer(body, np.uint8)
        slot[_CRC_SPAN : _DTYPE.itemsize] = np.frombuffer(_CRC.pack(zlib.crc32(body)), np.uint8)
        return new


class MarkerReplicas:
    """The marker page's two-tier protection: pages 1 and 2 of the marker region are copies.

    For one data page an MDS code is a repetition code (any [n, 1] MDS code is, up to a factor
    per parity page), so the marker's 1 + 1 + 1 group — a first-tier page over the marker, a
    second-tier page over that — is two replicas, and any two of the three pages may be lost,
    as with the general codec. Each marker write copies only the slot it changed (about a
    microsecond, against ~70 us for the codec's call path, paid on each of the three marker
    writes per chunk transaction).

    Args:
        pages: uint8 CPU tensor [3, page]: the marker page, then its two protection pages.
    """

    def __init__(self, pages: torch.Tensor) -> None:
        if pages.dim() != 2 or pages.shape[0] != 3 or pages.dtype != torch.uint8:
            raise ValueError("marker protection needs a uint8 tensor of 3 pages")
        self._pages = pages.numpy()

    def encode(self) -> None:
        """Copy the whole marker page to both protection pages."""
        self._pages[1:] = self._pages[0]

    def copy_range(self, offset: int, length: int) -> None:
        """Copy bytes [offset, offset + length) of the marker page (the slot just written)."""
        end = offset + length
        self._pages[1, offset:end] = self._pages[0, offset:end]
        self._pages[2, offset:end] = self._pages[0, offset:end]

    def reconstruct(self, lost) -> None:
        """Rebuild the `lost` pages (of 0, 1, 2) from a surviving one (the marker page first,
        then the first-tier copy: at most one write behind if a copy was torn by the crash).

        Raises:
            UnrecoverableError: all three pages are lost.
        """
        from unbroken.erasure import UnrecoverableError

        lost = {int(p) for p in lost}
        survivors = [p for p in range(3) if p not in lost]
        if not survivors:
            raise UnrecoverableError(group="marker", lost=lost)
        for p in lost:
            self._pages[p] = self._pages[survivors[0]]
