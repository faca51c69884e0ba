"""The progress marker: a tiny retained record of how far the update phase has come.

Two slots of 128 bytes; a write goes to the slot after the current one and carries an
increasing sequence number and a CRC-32 of the slot, written last. A write torn by a crash
leaves a slot whose CRC does not match; `read` returns the valid slot with the highest sequence
number, i.e. the last completed write. Each write is made after the operation it records has
completed (see `Stage`).
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = ["MARKER_BYTES", "MarkerState", "ProgressMarker", "Stage"]

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

    def write(self, **changes) -> MarkerState:
        """Record a new state (fields not given keep their values)."""
        base = self._state or MarkerState()
        new = replace(base, seq=base.seq + 1, **changes)
        slot = self._slots[new.seq % 2]
        rec = np.zeros(1, dtype=_DTYPE)
        for name in _DTYPE.names[:-1]:
            rec[name] = getattr(new, name)
        body = rec.view(np.uint8)
        slot[:_CRC_SPAN] = body[:_CRC_SPAN]
        slot[_CRC_SPAN : _DTYPE.itemsize] = np.frombuffer(
            np.uint64(zlib.crc32(body[:_CRC_SPAN].tobytes())).tobytes(), np.uint8
        )
        self._state = new
        return new
