"""Coordinator-side recovery state machine for one run.

    STARTING --all trainers started--> RUNNING --every rank exited 0--> DONE
    RUNNING --rank exit != 0 / rank hung--> STOPPING (kill the whole generation)
    STOPPING --agents report stopped--> RESTARTING (start generation+1 with resume)
    RESTARTING --all started--> RUNNING
    any --max_restarts exceeded / node lost--> FAILED

Two recovery modes. `inplace` (the default for hardware-operable failures): new trainer
processes reattach to the state their state managers retained, repair it and finish or redo the
interrupted iteration — no checkpoint, no recomputation of completed iterations. `ckpt_restart`
(the baseline, and the fallback): every rank restarts from the newest complete checkpoint and
recomputes. A trainer that finds its retained state beyond repair exits with `FATAL_EXIT`; the
machine then falls back to `ckpt_restart` for that recovery. Failures reported for an older
generation (the other ranks of a generation being torn down) are ignored: one failure, one
recovery. A generation that fails without an injected fault and without completing an iteration,
three times in a row, is a crash loop: FAILED instead of restarting forever.

Detected failures arrive through the detectors' one interface, `unbroken.detect.DetectionEvent`
(`on_detection`): fail-stop events (a rank's exit, a hung rank, a lost node) drive the
transitions above; fail-slow reports change no state yet (the planner that re-plans around a
slow rank will consume them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause

__all__ = ["FATAL_EXIT", "Action", "RecoveryMachine", "RecoveryState"]

FATAL_EXIT = 3
"""Exit status of a trainer whose retained state cannot be repaired in place."""


class RecoveryState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Action:
    """What the coordinator must do next: `op` in {start, stop, finish, fail}."""

    op: str
    generation: int
    resume: bool = False
    reason: str = ""
    recovery: str = "fresh"
    """How the started generation obtains its state: fresh, inplace or ckpt_restart."""


@dataclass(slots=True)
class RecoveryMachine:
    world_size: int
    max_restarts: int
    mode: str = "ckpt_restart"
    state: RecoveryState = RecoveryState.STARTING
    generation: int = 0
    restarts: int = 0
    finished_ranks: set[int] = field(default_factory=set)
    fallback: bool = False
    stalled_failures: int = 0
    transitions: list[tuple[str, str, str]] = field(default_factory=list)

    def _go(self, new: RecoveryState, reason: str) -> None:
        self.transitions.append((self.state.value, new.value, reason))
        self.state = new

    def begin(self) -> Action:
        return Action("start", self.generation, resume=False, reason="job start")

    def on_started(self, generation: int) -> None:
        if generation == self.generation and self.state in (
            RecoveryState.STARTING,
            RecoveryState.RESTARTING,
        ):
            self._go(RecoveryState.RUNNING, f"generation {generation} started")

    def on_rank_exit(self, rank: int, generation: int, returncode: int) -> Action | None:
        if generation != self.generation or self.state not in (
            RecoveryState.RUNNING,
            RecoveryState.STARTING,
            RecoveryState.RESTARTING,
        ):
            return None
        if returncode == 0:
            self.finished_ranks.add(rank)
            if len(self.finished_ranks) == self.world_size:
                self._go(RecoveryState.DONE, "every rank finished")
                return Action("finish", generation)
            return None
        if returncode == FATAL_EXIT:
            self.fallback = True
            return self._failure(f"rank {rank}: retained state beyond repair; checkpoint fallback")
        return self._failure(f"rank {rank} exited with status {returncode}")

    def on_detection(self, event: DetectionEvent) -> Action | None:
        """A detected failure. Fail-stop: the transition of its cause (exit, hang, node lost);
        stale generations are ignored as in `on_rank_exit`. Fail-slow: no action yet.

        Raises:
            ValueError: a fail-stop event without a known cause or its cause's fields.
        """
        if event.kind is not DetectionKind.FAIL_STOP:
            return None
        cause = FailStopCause(event.cause)
        if cause is FailStopCause.NODE_LOST:
            return self.on_node_lost(event.reason)
        if event.rank is None or event.generation is None:
            raise ValueError(f"fail-stop {cause.value} needs rank and generation: {event}")
        if cause is FailStopCause.EXIT:
            if event.returncode is None:
                raise ValueError(f"fail-stop exit needs returncode: {event}")
            return self.on_rank_exit(event.rank, event.generation, event.returncode)
        return self.on_rank_hung(event.rank, event.generation, event.silent_s or 0.0)

    def on_rank_hung(self, rank: int, generation: int, silent_s: float) -> Action | None:
        if generation != self.generation or self.state not in (
            RecoveryState.RUNNING,
            RecoveryState.STARTING,
            RecoveryState.RESTARTING,
        ):
            return None
        return self._failure(f"rank {rank} hung (no heartbeat for {silent_s:.2f}s)")

    def note_progress(self, progressed: bool, injected: bool) -> None:
        """Before a failure is handled: did the failing generation complete an iteration, and
        was the failure injected? Three stalled, uninjected failures in a row are a crash loop."""
        self.stalled_failures = 0 if (progressed or injected) else self.stalled_failures + 1

    def _failure(self, reason: str) -> Action:
        # A trainer that asked for the checkpoint fallback gets it even after stalled failures:
        # it is a different recovery, not the same one looping. If that fails too, it is a loop.
        if self.stalled_failures >= 3 and not self.fallback:
            self._go(RecoveryState.FAILED, f"{reason}; crash loop (no progress three times)")
            return Action("fail", self.generation, reason=f"crash loop: {reason}")
        if self.restarts >= self.max_restarts:
            self._go(RecoveryState.FAILED, f"{reason}; max_restarts={self.max_restarts} reached")
            return Action("fail", self.generation, reason=reason)
        self._go(RecoveryState.STOPPING, reason)
        return Action("stop", self.generation, reason=reason)

    def on_stopped(self, generation: int) -> Action | None:
        if self.state is not RecoveryState.STOPPING or generation != self.generation:
            return None
        self.restarts += 1
        self.generation += 1
        self.finished_ranks.clear()
        mode = "ckpt_restart" if self.fallback else self.mode
        self.fallback = False
        self._go(RecoveryState.RESTARTING, f"{mode}: start generation {self.generation}")
        return Action("start", self.generation, resume=True, reason=mode, recovery=mode)

    def on_node_lost(self, reason: str) -> Action:
        self._go(RecoveryState.FAILED, f"node lost: {reason}")
        return Action("fail", self.generation, reason=reason)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state.value, "generation": self.generation, "restarts": self.restarts}
