"""The phases of one iteration and the hook signature called at each phase boundary.

See ARCHITECTURE.md "One iteration". A hook is called at the *start* of a phase with the
iteration number and a step index within the phase (micro-batch for forward/backward, chunk for
update, 0 otherwise), so fault injection can hit "inside a chunk's update" precisely.
"""

from __future__ import annotations

import enum
from typing import Protocol

__all__ = ["Phase", "PhaseHook"]


class Phase(enum.StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    PROTECT = "protect"
    SYNC = "sync"
    UPDATE = "update"
    """A chunk's optimizer update (after its undo copy, before the in-place step)."""
    PARITY = "parity"
    """A chunk's parity delta being computed into scratch (data already updated)."""
    WRITEBACK = "writeback"
    """Scratch parity being written back (first tier written, second tier not yet)."""
    MARKER = "marker"
    """Inside a progress-marker write (body written, checksum not yet)."""
    BOUNDARY = "boundary"


class PhaseHook(Protocol):
    def __call__(self, phase: Phase, iteration: int, step: int, n_steps: int) -> None: ...
