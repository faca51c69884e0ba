"""What a live observer of a run is told, and when: the interface the coordinator's run monitor
calls (`launch.coordinator.monitor.RunMonitor`) for the Prometheus exporter
(`metrics.prom`), the status page's model (`metrics.status`) and any observer a Python caller
passes to `unbroken.run_job(observers=...)`.

The monitor reads the run's logs as they grow and calls, in the coordinator's main thread:
`started` once, then `iteration` for each row of `metrics.jsonl`, `timing` for each row of
`timings.jsonl`, `event` for each event of `events.jsonl` (all of this run's: the
coordinator's, the agent's decisions and the trainers'), `recovered` once a detected failure
is recovered (with its breakdown), and `finished` at the end. Rows and events are the
dictionaries documented in docs/outputs.md.

An observer only watches: it never takes a control decision, and what it does must be quick
(the coordinator's loop waits for it). It must not raise; the monitor does not catch.
Nothing here imports Prometheus or any server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unbroken.metrics.analysis import RecoveryBreakdown

__all__ = ["RunInfo", "RunObserver"]


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a run is, as its observers see it when it starts."""

    run: str
    """The run's name ("train", "reference", "faulty")."""
    world_size: int
    iterations: int
    """Iterations the run is to complete."""
    recovery_mode: str
    """`recovery.mode`: inplace or ckpt_restart."""
    shadow_level: int
    """The configured shadow level (0: none)."""
    plan: str
    """The parallel plan in one or more lines ("data parallel: 4 replicas" without a plan)."""
    placement: dict[int, tuple[int, int]] = field(default_factory=dict)
    """rank -> (replica, stage) under a plan; empty for data parallelism."""


class RunObserver:
    """A live observer of one or more runs; every method does nothing until overridden."""

    def started(self, info: RunInfo) -> None:
        """A run starts (a job with a reference starts two runs, one after the other)."""

    def iteration(self, row: dict[str, Any]) -> None:
        """An iteration attempt completed (a `metrics.jsonl` row)."""

    def timing(self, row: dict[str, Any]) -> None:
        """A rank's timings of an iteration (a `timings.jsonl` row)."""

    def event(self, event: dict[str, Any]) -> None:
        """An event of the run (an `events.jsonl` record)."""

    def recovered(self, breakdown: RecoveryBreakdown) -> None:
        """A detected failure was recovered; `breakdown` is its `summary.json` row."""

    def finished(self, state: str, reason: str) -> None:
        """The run ended in `state` (done or failed) for `reason`."""
