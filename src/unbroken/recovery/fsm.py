"""Coordinator-side recovery state machine for one run: states, an explicit transition table,
and typed actions for the coordinator to execute.

    STARTING   --every node started its trainers-->      RUNNING
    RUNNING    --every rank exited DONE-->               DONE
    STARTING/RUNNING/RESTARTING --a live rank failed-->  STOPPING (stop the whole generation)
    STOPPING   --every node stopped its trainers-->      RESTARTING (start generation + 1)
    RESTARTING --every node started its trainers-->      RUNNING
    any live state --restart budget spent, crash loop, node lost, no plan--> FAILED
    STARTING/RUNNING/RESTARTING --a device or node lost--> STOPPING when the job re-plans
                                                         (`replans`), else FAILED
    RUNNING    --a lost node returned (re-plans)-->    STOPPING (planned: no restart counted)
    RUNNING    --a slow device evicted (`evicts`)-->   STOPPING (restart from a checkpoint)

Any other transition raises `IllegalTransition` (`ALLOWED` lists them): the machine cannot
wander into a state nobody designed. Each transition is recorded with its reason for the event
log. The machine is pure — no processes, no clock — so it is tested alone.

How the next generation obtains its state is `unbroken.recovery.decision.restore_mode`: in
place when the job retains state, from a checkpoint otherwise or when a rank of the failed
generation exited with `RankExit.FALLBACK` (its retained state beyond repair; that fallback
holds for one recovery). Failures reported for an older generation (the other ranks of a
generation being torn down) are ignored: one failure, one recovery. A generation that fails
without an injected fault and without completing an iteration, three times in a row, is a
crash loop: FAILED instead of restarting forever. When every rank of a generation fails before
its first iteration with the same error (a model that cannot be built, a plan that does not
fit), no restart can help: the coordinator reports it (`on_startup_failure`) and the job fails
at once.

Detected failures arrive through the detectors' one interface, `unbroken.detect.DetectionEvent`
(`on_detection`): fail-stop events (a rank's exit, a hung rank, a lost node, a lost device)
drive the transitions above; fail-slow reports change no state (the coordinator's re-planning
consumes them). A lost device is recovered like any failure when the job re-plans (the
coordinator starts the next generation on the remaining devices, `world_size` shrinks);
without re-planning nothing can replace it and the job fails with the reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.recovery.decision import RankExit, RestoreMode, restore_mode

__all__ = [
    "ALLOWED",
    "FATAL_EXIT",
    "Action",
    "Fail",
    "Finish",
    "IllegalTransition",
    "RecoveryMachine",
    "RecoveryState",
    "Start",
    "Stop",
]

FATAL_EXIT = int(RankExit.FALLBACK)
"""Exit status of a trainer whose retained state cannot be repaired in place."""

CRASH_LOOP = 3
"""Stalled, uninjected failures in a row that make a crash loop."""


class RecoveryState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    DONE = "done"
    FAILED = "failed"


_S = RecoveryState
ALLOWED: dict[RecoveryState, frozenset[RecoveryState]] = {
    _S.STARTING: frozenset({_S.RUNNING, _S.STOPPING, _S.DONE, _S.FAILED}),
    _S.RUNNING: frozenset({_S.STOPPING, _S.DONE, _S.FAILED}),
    _S.STOPPING: frozenset({_S.RESTARTING, _S.FAILED}),
    _S.RESTARTING: frozenset({_S.RUNNING, _S.STOPPING, _S.DONE, _S.FAILED}),
    _S.DONE: frozenset(),
    _S.FAILED: frozenset(),
}
"""Every transition the machine may take."""

_LIVE = frozenset({_S.STARTING, _S.RUNNING, _S.RESTARTING})
"""States with a generation whose failures count."""


class IllegalTransition(RuntimeError):
    """A transition `ALLOWED` does not list (a bug in the machine or its caller)."""


@dataclass(frozen=True, slots=True)
class Start:
    """Start `generation`, whose trainers obtain their state by `restore`."""

    generation: int
    restore: RestoreMode
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop every trainer of `generation` (a failure is being recovered)."""

    generation: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Finish:
    """The job is done: shut the nodes down."""

    generation: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Fail:
    """The job cannot go on: shut the nodes down and report `reason`."""

    generation: int
    reason: str = ""


Action = Start | Stop | Finish | Fail


@dataclass(slots=True)
class RecoveryMachine:
    """Args: world_size (ranks that must finish), max_restarts (recoveries allowed), retains_state
    (in-place recovery: the job's state survives in state managers)."""

    world_size: int
    max_restarts: int
    retains_state: bool = False
    replans: bool = False
    """The job continues on fewer devices after one is lost (`adapt.enabled`)."""
    evicts: bool = False
    """Evict-and-restart (`adapt.policy = "evict"`): a lost device or node, or a device evicted
    for being slow (`on_evict`), is recovered from the newest checkpoint on the others, not in
    place."""
    state: RecoveryState = RecoveryState.STARTING
    generation: int = 0
    restarts: int = 0
    finished_ranks: set[int] = field(default_factory=set)
    fallback: bool = False
    stalled_failures: int = 0
    planned: bool = False
    """The generation is stopping for a re-plan that adds devices, not after a failure."""
    transitions: list[tuple[str, str, str]] = field(default_factory=list)

    def _go(self, new: RecoveryState, reason: str) -> None:
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {new.value} ({reason})")
        self.transitions.append((self.state.value, new.value, reason))
        self.state = new

    def _live(self, generation: int) -> bool:
        return generation == self.generation and self.state in _LIVE

    @property
    def over(self) -> bool:
        return self.state in (_S.DONE, _S.FAILED)

    def begin(self) -> Start:
        return Start(self.generation, restore_mode(self.retains_state, 0, False), "job start")

    def on_started(self, generation: int) -> None:
        if generation == self.generation and self.state in (_S.STARTING, _S.RESTARTING):
            self._go(_S.RUNNING, f"generation {generation} started")

    def on_rank_exit(self, rank: int, generation: int, returncode: int) -> Action | None:
        if not self._live(generation):
            return None
        if returncode == RankExit.DONE:
            self.finished_ranks.add(rank)
            if len(self.finished_ranks) == self.world_size:
                self._go(_S.DONE, "every rank finished")
                return Finish(generation, "every rank finished")
            return None
        if returncode == RankExit.FALLBACK:
            self.fallback = True
            return self._failure(f"rank {rank}: retained state beyond repair; checkpoint fallback")
        return self._failure(f"rank {rank} exited with status {returncode}")

    def on_detection(self, event: DetectionEvent) -> Action | None:
        """A detected failure. Fail-stop: the transition of its cause (exit, hang, node lost);
        stale generations are ignored as in `on_rank_exit`. Fail-slow: no action.

        Raises:
            ValueError: a fail-stop event without a known cause or its cause's fields.
        """
        if event.kind is not DetectionKind.FAIL_STOP:
            return None
        cause = FailStopCause(event.cause)
        if cause is FailStopCause.NODE_LOST:
            return self.on_node_lost(event.reason)
        live = self._live(event.generation if event.generation is not None else -1)
        if cause is FailStopCause.DEVICE_LOST and self.evicts and live:
            self.fallback = True
        if cause is FailStopCause.DEVICE_LOST and not self.replans:
            if not live:
                return None
            self._go(_S.FAILED, f"{event.reason}; the job does not re-plan (adapt.enabled)")
            return Fail(self.generation, event.reason)
        if event.rank is None or event.generation is None:
            raise ValueError(f"fail-stop {cause.value} needs rank and generation: {event}")
        if cause in (FailStopCause.EXIT, FailStopCause.DEVICE_LOST):
            if event.returncode is None:
                raise ValueError(f"fail-stop exit needs returncode: {event}")
            return self.on_rank_exit(event.rank, event.generation, event.returncode)
        return self.on_rank_hung(event.rank, event.generation, event.silent_s or 0.0)

    def on_rank_hung(self, rank: int, generation: int, silent_s: float) -> Action | None:
        if not self._live(generation):
            return None
        return self._failure(f"rank {rank} hung (no heartbeat for {silent_s:.2f}s)")

    def note_progress(self, progressed: bool, injected: bool) -> None:
        """Before a failure is handled: did the failing generation complete an iteration, and
        was the failure injected? Three stalled, uninjected failures in a row are a crash loop."""
        self.stalled_failures = 0 if (progressed or injected) else self.stalled_failures + 1

    def loop_explained(self) -> None:
        """The stalled failures so far have a cause the coordinator acted on (a device found
        crash-looping is excluded): they do not count toward the job's crash loop."""
        self.stalled_failures = 0

    def _failure(self, reason: str) -> Action:
        # A trainer that asked for the checkpoint fallback gets it even after stalled failures:
        # it is a different recovery, not the same one looping. If that fails too, it is a loop.
        if self.stalled_failures >= CRASH_LOOP and not self.fallback:
            self._go(_S.FAILED, f"{reason}; crash loop (no progress three times)")
            return Fail(self.generation, f"crash loop: {reason}")
        if self.restarts >= self.max_restarts:
            self._go(_S.FAILED, f"{reason}; max_restarts={self.max_restarts} reached")
            return Fail(self.generation, reason)
        self._go(_S.STOPPING, reason)
        return Stop(self.generation, reason)

    def on_stopped(self, generation: int) -> Start | None:
        if self.state is not _S.STOPPING or generation != self.generation:
            return None
        if not self.planned:
            self.restarts += 1
        self.planned = False
        self.generation += 1
        self.finished_ranks.clear()
        mode = restore_mode(self.retains_state, self.generation, self.fallback)
        self.fallback = False
        self._go(_S.RESTARTING, f"{mode.value}: start generation {self.generation}")
        return Start(self.generation, mode, mode.value)

    def on_startup_failure(self, reason: str) -> Fail | None:
        """Every rank of the running generation failed before its first iteration with the same
        error: a deterministic start-up failure that no restart can fix. Fail at once."""
        if self.state not in _LIVE:
            return None
        self._go(_S.FAILED, f"start-up failure on every rank: {reason}")
        return Fail(self.generation, reason)

    def on_node_lost(self, reason: str) -> Action | None:
        """A node is gone with its devices. A job that re-plans stops the generation (its
        ranks on other nodes wait on collectives with the lost ones) and continues without
        them, like after a lost device; one already stopping just goes on. Else FAILED."""
        if self.over:
            return None
        if not self.replans:
            self._go(_S.FAILED, f"node lost: {reason}")
            return Fail(self.generation, reason)
        if self.state is _S.STOPPING:
            return None
        self.fallback = self.fallback or self.evicts
        return self._failure(f"node lost: {reason}")

    def on_evict(self, reason: str) -> Stop | None:
        """A device evicted for being slow (`evicts`): stop the running generation; the next
        one starts from the newest checkpoint on the other devices (a restart is counted, like
        any checkpoint restart). None when not running."""
        if not self.evicts or self.state is not _S.RUNNING:
            return None
        self.fallback = True
        return self._failure(f"evicted: {reason}")

    def on_grow(self, reason: str) -> Stop | None:
        """Devices came back (a lost node rejoined): a job that re-plans stops the running
        generation to start the next one on the larger world, in place. Not a failure: no
        restart is counted. None when not running (the caller retries once it is)."""
        if not self.replans or self.state is not _S.RUNNING:
            return None
        self.planned = True
        self._go(_S.STOPPING, reason)
        return Stop(self.generation, reason)

    def give_up(self, reason: str) -> Fail | None:
        """Nothing can run the job any more (no device left to re-plan on): FAILED."""
        if self.over:
            return None
        self._go(_S.FAILED, reason)
        return Fail(self.generation, reason)

    def resize(self, world_size: int) -> None:
        """The next generation runs `world_size` ranks (a lost device was planned around)."""
        if world_size < 1:
            raise ValueError(f"a world of {world_size} ranks")
        self.world_size = world_size

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state.value, "generation": self.generation, "restarts": self.restarts}
