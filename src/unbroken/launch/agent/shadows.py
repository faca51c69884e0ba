"""The agent's shadow pool: the pre-initialized trainers of the next generation (see
`unbroken.shadow` and docs/architecture.md "Shadow trainers").

Life of a set of shadows, for generation N+1 while generation N trains:

- pending: asked for with generation N (`prepare`), waiting for the node's fork server to
  finish its imports; spawned from the supervision loop (`spawn_pending`, every tick), never
  blocking it. A fork server that failed means they are spawned with `exec`.
- live / ready: every rank has a live shadow for the generation (`alive_for`; it need not have
  reached its level: a promoted shadow finishes its pre-initialization first, which still beats
  starting a process from nothing); ready ones have reported SHADOW_READY (`ready_count`).
- warmed: once its rank's trainer of generation N has completed an iteration, a shadow is told
  to run its GPU warm-up (`tell`, `WarmUp`): a recovery's successor shadows warm up after the
  promoted trainer's first iteration, not beside it.
- premapped: a parked shadow whose rank's trainer of generation N has completed an iteration
  is told to map the device's retained state (`tell`, `MapRetained`): the regions are made
  by then, and nothing re-creates them before generation N+1 starts.
- promoted: generation N+1 starts from them (`promote`): full CPU priority again, the final
  spec as a `Promote` line on stdin; they become the generation's trainers.
- reclaimed: killed all at once and waited for (`reclaim`): their memory returns together.
- relaunched: after a reclamation, the same generation's shadows again at the level the
  policy allows (`relaunch`) — at once, or once a trainer's heartbeat shows it got past the
  iteration it retried after an allocation failure (`relaunch_after`, `on_beat`).

Every set of shadows gets its own attempt number (it rendezvouses under its own store prefix).
The pool decides nothing about memory: `unbroken.launch.agent.reclaim` does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from dataclasses import dataclass

from unbroken.launch.agent.procs import RankProc
from unbroken.launch.agent.supervisor import ProcessSupervisor
from unbroken.messages import (
    MapRetained,
    Promote,
    RankBeat,
    RankStatus,
    ShadowLaunch,
    StartGeneration,
    WarmUp,
    encode_json,
)

__all__ = ["PendingShadows", "RelaunchAfter", "ShadowPool"]


@dataclass(frozen=True, slots=True)
class PendingShadows:
    """Shadows waiting for the fork server: spawned from `plan` for `generation` at `level`."""

    plan: StartGeneration
    generation: int
    level: int
    ranks: tuple[int, ...]
    relaunch: bool = False
    """A node-local relaunch after a reclamation (a set number of its own)."""


RELAUNCH_BASE = 1_000_000
"""Shadow sets a node relaunches on its own number from here (the coordinator numbers the
others by generation)."""


@dataclass(frozen=True, slots=True)
class RelaunchAfter:
    """Shadows reclaimed for `rank`'s allocation failure come back, for `generation` at
    `level`, once that rank's heartbeat is past `iteration` (the one it retried): a shadow
    starting meanwhile would compete for the memory just freed."""

    rank: int
    iteration: int
    level: int
    generation: int


class ShadowPool:
    """The node's shadows, by rank.

    Args:
        supervisor: spawns and kills them.
    """

    def __init__(self, supervisor: ProcessSupervisor) -> None:
        self.supervisor = supervisor
        self.shadows: dict[int, RankProc] = {}
        self.pending: PendingShadows | None = None
        self.relaunch_after: RelaunchAfter | None = None
        self.attempt = 0
        """Sets of shadows started so far."""
        self.level_now = 0
        """The level of the shadows asked for last."""
        self.plan: StartGeneration | None = None
        """The generation start whose shadow plan the pool follows (the latest)."""
        self.job_nice = os.getpriority(os.PRIO_PROCESS, 0)
        """The job's own niceness (the agent's, inherited from the command): a promoted shadow
        returns to it, not to 0 — a job started under `nice` keeps every trainer at one
        priority, or its collectives wait for the ranks left behind."""

    # -- what there is ------------------------------------------------------------------------
    def live(self) -> list[RankProc]:
        return [t for t in self.shadows.values() if t.alive()]

    def alive_for(self, generation: int, ranks: Collection[int]) -> bool:
        """Every rank in `ranks` has a live shadow for `generation`."""
        return all(
            (t := self.shadows.get(r)) is not None and t.generation == generation and t.alive()
            for r in ranks
        )

    def ready_count(self, ranks: Collection[int]) -> int:
        """How many of `ranks`' shadows have reported they are parked at their level."""
        return sum(_parked(self.shadows[r]) for r in ranks)

    def find(self, rank: int) -> RankProc | None:
        return self.shadows.get(rank)

    # -- transitions ----------------------------------------------------------------------------
    def promote(self, rank: int, spec: str, now: float, *, as_rank: int | None = None) -> RankProc:
        """Turn `rank`'s shadow into the trainer of the generation whose final spec is `spec`
        (check `alive_for` first); `as_rank`: its rank in a changed world (it regroups)."""
        t = self.shadows.pop(rank)
        _renice_threads(t.proc.pid, self.job_nice)
        assert t.proc.stdin is not None
        msg = Promote(spec=spec, rank=as_rank, regroup=as_rank is not None)
        t.proc.stdin.write(encode_json(msg) + b"\n")
        t.proc.stdin.flush()
        t.liveness = t.liveness.promoted(now)
        if as_rank is not None:
            t.rank = as_rank
        return t

    def by_device(self, generation: int) -> dict[int, int]:
        """device -> the rank of its live shadow prepared for `generation` that is parked (the
        devices of the generation start the shadows were prepared under).

        Parked only: this is the world-change path, and a shadow still on its way to its level
        may be inside its set's group formation (L3), waiting for peers of the old world that
        are gone with a lost node. Promoted there, it waited out the collective timeout (60 s)
        before the new world could train: a two-node CI run, where node 1 died 5 iterations
        into the job, before node 0's shadows had parked on the loaded machine. A fresh trainer
        starts instead."""
        if self.plan is None:
            return {}
        devices = self.plan.devices
        return {
            devices.get(str(r), r): r
            for r, t in self.shadows.items()
            if t.generation == generation and t.alive() and _parked(t)
        }

    def reclaim(self) -> None:
        """Kill every shadow and wait until each is gone; pending ones are dropped."""
        self.pending = None
        self.supervisor.kill(t.proc for t in self.shadows.values())
        self.shadows.clear()

    def prepare(self, plan: StartGeneration, level: int) -> ShadowLaunch | None:
        """With generation `plan.generation` started: pre-initialize its successor's shadows at
        `level` (0: none). Returns what was launched, for the `Started` message."""
        self.plan = plan
        self.relaunch_after = None  # this start brings its own shadows
        if not level or plan.shadows is None:
            return None
        if plan.shadows.start == "fork":
            self.supervisor.start_forkserver()
        generation = plan.generation + 1
        self.pending = PendingShadows(plan, generation, level, tuple(plan.ranks))
        self.spawn_pending()
        sup = self.supervisor
        started_fork = sup.forkserver is not None and sup.forkserver.failed is None
        self.level_now = level
        return ShadowLaunch(
            level=level,
            generation=generation,
            start="fork" if started_fork else "exec",
            fork_failed=sup.fork_failed(),
        )

    def spawn_pending(self) -> None:
        """Spawn the waiting shadows once the fork server is ready (or has failed: then with
        exec, as without one)."""
        pending = self.pending
        if pending is None or self.supervisor.forkserver_starting():
            return
        self.pending = None
        assert pending.plan.shadows is not None
        given = pending.plan.shadows.attempt
        if given and not pending.relaunch:
            self.attempt = given
        else:  # counted here; a relaunch's numbers stay clear of the coordinator's
            self.attempt = max(self.attempt, RELAUNCH_BASE) + 1 if given else self.attempt + 1
        spec = pending.plan.shadows.next_spec
        for r in pending.ranks:
            self.shadows[r] = self.supervisor.spawn(
                pending.plan, r, pending.generation, spec, pending.level, self.attempt
            )

    def relaunch(self, level: int, generation: int, ranks: Collection[int]) -> None:
        """After a reclamation: `generation`'s shadows again for `ranks`, at `level` (0:
        none)."""
        self.level_now = level
        if level:
            assert self.plan is not None
            self.pending = PendingShadows(
                self.plan, generation, level, tuple(sorted(ranks)), relaunch=True
            )
            self.spawn_pending()

    def tell(self, trainers: dict[int, RankProc]) -> None:
        """Each shadow whose rank's trainer of the generation before has completed an
        iteration is told, once each: `WarmUp` (its GPU warm-up no longer competes with that
        trainer's first iteration, `recovery.shadow_warmup`) and, once parked, `MapRetained`
        (map the retained state now). Not sooner for the mapping: until then that trainer may
        still make its regions anew (a restart under another plan, a state moved to another
        layout), and a shadow mapping the old ones would keep their memory."""
        for rank, t in self.shadows.items():
            if not _trained(trainers.get(rank), t.generation - 1) or not t.alive():
                continue
            if not t.warm_sent:
                t.warm_sent = True
                _tell(t, WarmUp())
            if not t.premap_sent and _parked(t):
                t.premap_sent = True
                _tell(t, MapRetained())

    def on_beat(self, beat: RankBeat, ranks: Collection[int]) -> None:
        """A heartbeat arrived: relaunch for `ranks` if it is the one `relaunch_after` waits
        for."""
        after = self.relaunch_after
        if after is None or beat.rank != after.rank or beat.iteration <= after.iteration:
            return
        self.relaunch_after = None
        self.relaunch(after.level, after.generation, ranks)


def _trained(trainer: RankProc | None, generation: int) -> bool:
    """`trainer` is of `generation` and has completed an iteration of it (its last beat)."""
    return (
        trainer is not None
        and trainer.generation == generation
        and trainer.beat is not None
        and trainer.beat.status is RankStatus.TRAINING
        and trainer.beat.completed >= 0
    )


def _tell(t: RankProc, msg: WarmUp | MapRetained) -> None:
    """One line on the shadow's stdin."""
    assert t.proc.stdin is not None
    with contextlib.suppress(OSError):  # it died meanwhile: its exit is reported
        t.proc.stdin.write(encode_json(msg) + b"\n")
        t.proc.stdin.flush()


def _parked(t: RankProc) -> bool:
    """The shadow reported it is parked at its level (its last heartbeat)."""
    return t.beat is not None and t.beat.status is RankStatus.SHADOW_READY


def _renice_threads(pid: int, nice: int) -> None:
    """Every thread of `pid` to the job's priority (needs privilege to raise it; else left).

    Every thread, not the process: on Linux a niceness belongs to a thread, and
    `setpriority(PRIO_PROCESS, pid)` changes only the thread whose id is `pid`. A shadow's other
    threads — its heartbeat, gloo's communication threads from the group it formed at L3 —
    were created at the shadow's niceness and kept it after promotion, so a promoted trainer's
    collectives ran at +10 beside fresh trainers at 0 on a loaded machine."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # gone, or no /proc: the process alone
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile; no privilege
            os.setpriority(os.PRIO_PROCESS, tid, nice)
