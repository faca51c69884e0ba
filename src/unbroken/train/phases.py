"""The phases of one iteration and the hook signature called at each phase boundary.

See ARCHITECTURE.md "One iteration". A hook is called at the *start* of a phase with the
iteration number and a step index within the phase (micro-batch for forward/backward, chunk for
update, bucket for allreduce, 0 otherwise), so fault injection can hit "inside a chunk's update"
precisely.

Order within the compute phase: FORWARD m, BACKWARD m for every micro-batch, then, with
data-parallel replicas, ALLREDUCE b before each all-reduce bucket and REDUCED after the last. So the
interval FORWARD m -> next hook is micro-batch m's compute, and ALLREDUCE 0 -> REDUCED is the
gradient communication (with any wait for the slowest replica).
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
    ALLREDUCE = "allreduce"
    """Right before one bucket's gradient all-reduce (step = bucket; compute phase)."""
    REDUCED = "reduced"
    """After the last gradient all-reduce bucket: gradients averaged over the replicas (not
    fired without replicas: there is no all-reduce)."""
    BOUNDARY = "boundary"
    MOVE = "move"
    """A generation moving the state to a new plan's layout (`unbroken.launch.relayout`), at
    the iteration it will start with: step 0 before the ranks exchange it, step 1 before its
    parity is written. A fault with `phase=move,iter=I` fires at the first move at or after I
    (when a re-plan moves layers depends on when the detector reports)."""


class PhaseHook(Protocol):
    def __call__(self, phase: Phase, iteration: int, step: int, n_steps: int) -> None: ...
