"""The one interface through which detected failures reach the recovery/planning layer.

Both detectors (heartbeat fail-stop in `unbroken.launch`, workload-aware fail-slow here) hand a
`DetectionEvent` to a `DetectionSink`; the recovery state machine and the planner implement the
sink (or read the event log a `JsonlSink` writes). A detector never decides what to do about a
failure: it says what failed, where, how badly, and when it was seen.

The coordinator is the sink of its own fail-stop decisions (a rank's exit, a hung rank, a lost
node): it writes them to the event log in the coordinator's record format and hands the same
event to the recovery state machine (`RecoveryMachine.on_detection`). `JsonlSink` appends to a
run's `events.jsonl` in its format (`{"t", "run", "kind", ...}`, docs/outputs.md): kind
`failure_detected` with `reason` = the failure kind, plus `cause`, `rank`, `stage`, `factor`,
`iter` (where the failure began) and `detected_iter`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from unbroken.metrics.log import JsonlLog

__all__ = [
    "DetectionEvent",
    "DetectionKind",
    "DetectionSink",
    "FailStopCause",
    "JsonlSink",
    "ListSink",
]


class DetectionKind(enum.StrEnum):
    FAIL_STOP = "fail_stop"
    """A rank stopped (heartbeat lost, process gone or hung)."""
    FAIL_SLOW = "fail_slow"
    """A rank runs, but slower than its peers by `factor`."""


class FailStopCause(enum.StrEnum):
    """How a fail-stop was decided (`DetectionEvent.cause` of a fail-stop)."""

    EXIT = "exit"
    """The rank's process exited with a non-zero status (seen by its agent at once)."""
    HANG = "hang"
    """The rank's heartbeats stopped (agent: silent past the timeout, checked in /proc)."""
    NODE_LOST = "node_lost"
    """The node's agent dropped its connection or its beats stopped (coordinator)."""
    DEVICE_LOST = "device_lost"
    """The rank's process exited and its device failed the agent's health check: the device is
    gone for the rest of the job (not hardware-operable)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectionEvent:
    """A detected failure."""

    kind: DetectionKind
    rank: int | None
    """Failed rank, or None when validation could not localize it."""
    stage: int | None = None
    """Pipeline stage of the rank (0 for a data-parallel plan)."""
    factor: float | None = None
    """Estimated slowdown factor (fail-slow): the rank's time over its healthy time."""
    iteration: int | None = None
    """Iteration at which the failure began (the located change point)."""
    detected_at: int | None = None
    """Iteration after which it was detected."""
    t: float = field(default_factory=time.time)
    """Wall-clock time of the detection."""
    reason: str = ""
    """Human-readable evidence (e.g. 'observed 1.52x predicted; rank 1 compute 1.49x peers')."""
    cause: str = ""
    """Fail-stop: a `FailStopCause`. Fail-slow: "compute" or "comm" (what is slow)."""
    generation: int | None = None
    """Fail-stop: the trainer generation the failed rank belonged to."""
    node: int | None = None
    """Fail-stop: the node (agent) that reported it, or that was lost."""
    returncode: int | None = None
    """Fail-stop by exit: the process's exit status (negative: killed by that signal)."""
    silent_s: float | None = None
    """Fail-stop by hang or node loss: seconds without a heartbeat when it was decided."""

    def to_record(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "kind": "failure_detected",
            "reason": self.kind.value,
            "cause": self.cause,
            "rank": self.rank,
            "stage": self.stage,
            "factor": self.factor,
            "iter": self.iteration,
            "detected_iter": self.detected_at,
            "evidence": self.reason,
        }


class DetectionSink(Protocol):
    """Receives detected failures (recovery orchestrator, planner, event log, tests)."""

    def emit(self, event: DetectionEvent) -> None: ...


class JsonlSink:
    """Appends events to a run's `events.jsonl` (shared safely with other writers)."""

    def __init__(self, path: str | Path, run: str) -> None:
        self._log = JsonlLog(path, run=run)

    def emit(self, event: DetectionEvent) -> None:
        self._log.write(event.to_record())

    def close(self) -> None:
        self._log.close()


@dataclass(slots=True)
class ListSink:
    """Keeps events in memory (tests, the bench)."""

    events: list[DetectionEvent] = field(default_factory=list)

    def emit(self, event: DetectionEvent) -> None:
        self.events.append(event)
