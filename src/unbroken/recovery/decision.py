"""The one recovery decision: how a generation obtains its state, and where the job resumes.

Two levels, both pure functions:

- **The coordinator's choice** for a new generation (`RestoreMode`): the first generation
  starts `FRESH`; after a failure it restarts `IN_PLACE` when the job retains state
  (`recovery.mode = "inplace"`), else from a `CHECKPOINT`; a rank that found its retained state
  beyond repair exits with `RankExit.FALLBACK`, and the next generation (only the next) restarts
  from a checkpoint (`restore_mode`). The choice travels in the generation's spec; trainers read
  nothing else to decide it.
- **The ranks' agreement** inside an in-place restart (`decide_restore`): every rank repairs
  what it retained on its own (no collective), summarizes it as a `RetainedSummary` (its progress
  marker and what it held), the summaries are all-gathered once, and every rank evaluates this
  same function on the same table, so every rank takes the same path — Leto §5.2's rule: if any
  rank passed the global synchronization of iteration t, every rank finishes t's update (with
  the recorded statistics); otherwise the iteration after the last completed one is (re)done.
  When some rank retained nothing (new regions, or a marker never written: its trainer died in
  its start-up) the ranks start over from where the job stands if no rank completed an
  iteration, else fall back to a checkpoint — unless every such rank, and every rank whose
  repair failed (loss beyond parity tolerance), has a data-parallel replica that repaired: then
  the others resume as above and each of those ranks is *filled* with its replica's state at
  the agreed boundary (`RankAction.FILL`; Leto §2.2's fallback avoided by the replica ResiHP's
  Figure 8 moves state from).

`unbroken.launch.restore` runs the collectives and executes the decision.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from unbroken.update.marker import MarkerState, Stage

__all__ = [
    "RankAction",
    "RankExit",
    "RestoreDecision",
    "RestoreMode",
    "RestorePath",
    "RetainedSummary",
    "decide_restore",
    "restore_mode",
]


class RestoreMode(enum.StrEnum):
    """How a generation's trainers obtain their state."""

    FRESH = "fresh"
    """The job's first generation: the initial state (and the iteration-0 checkpoint)."""
    IN_PLACE = "inplace"
    """Reattach the retained state, repair it, agree on one boundary, continue."""
    CHECKPOINT = "ckpt_restart"
    """The newest complete checkpoint (or the initial state when there is none), recomputing
    what came after it: the baseline, and the fallback."""
    RESHARD = "reshard"
    """A planned re-plan that moves layers between the ranks (issue 18): reattach the retained
    state of the plan the devices ran before (`GenerationSpec.plan_before`), bring it to one
    boundary in place, then move parameters and optimizer moments to the new plan's layout
    between the ranks (`unbroken.launch.relayout`); no checkpoint."""


class RankExit(enum.IntEnum):
    """A trainer's exit status, as the coordinator reads it."""

    DONE = 0
    FAILED = 1
    FALLBACK = 3
    """The retained state is beyond in-place repair on some rank: restart from a checkpoint."""


def restore_mode(retains_state: bool, generation: int, fallback: bool) -> RestoreMode:
    """The coordinator's choice for `generation`.

    Args:
        retains_state: the job keeps its state in state managers (in-place recovery).
        generation: the generation about to start.
        fallback: a rank of the previous generation exited with `RankExit.FALLBACK`.
    """
    if generation == 0:
        return RestoreMode.FRESH
    return RestoreMode.IN_PLACE if retains_state and not fallback else RestoreMode.CHECKPOINT


@dataclass(frozen=True, slots=True)
class RetainedSummary:
    """What one rank found in its retained state, before any collective.

    Attributes:
        held: the rank retained something (its regions were not new and its marker was
            written at least once).
        repaired: its repair succeeded (False: beyond parity tolerance, a lost undo buffer...).
        progress: a completed iteration could be lost without it (its marker records one, or
            it could not tell because the repair failed).
        marker: its progress marker after the repair (None unless repaired).
        empty: the rank holds no state at all (a rank of no stage in its plan: a standby
            inside the world); the decision leaves it out ([Note: a rank of no stage]).
    """

    held: bool
    repaired: bool
    progress: bool
    marker: MarkerState | None = None
    empty: bool = False

    ROW = 11
    """Floats per row of the gathered table."""

    def to_row(self) -> list[float]:
        m = self.marker or MarkerState()
        return [
            float(self.held),
            float(self.repaired),
            float(self.progress),
            float(m.stage),
            float(m.iteration),
            float(m.done_iter),
            m.loss,
            m.grad_norm,
            m.grad_scale,
            m.lr,
            float(self.empty),
        ]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RetainedSummary:
        held, repaired, progress = (bool(x) for x in row[:3])
        marker = None
        if repaired:
            marker = MarkerState(
                stage=Stage(int(row[3])),
                iteration=int(row[4]),
                done_iter=int(row[5]),
                loss=float(row[6]),
                grad_norm=float(row[7]),
                grad_scale=float(row[8]),
                lr=float(row[9]),
            )
        return cls(
            held=held, repaired=repaired, progress=progress, marker=marker, empty=bool(row[10])
        )


class RestorePath(enum.StrEnum):
    RESUME = "resume"
    """Continue in place at `RestoreDecision.next_iteration`."""
    START_OVER = "start_over"
    """No rank retained progress: start where the job stands (initial state or checkpoint) in
    this generation; nothing is lost."""
    FALLBACK = "fallback"
    """Progress cannot be recovered in place: every rank exits `RankExit.FALLBACK`."""


class RankAction(enum.StrEnum):
    """What one rank does to reach the agreed boundary (RESUME only)."""

    FINISH_UPDATE = "finish the update from its last committed chunk"
    FINISH_WITH_PEER_STATS = "finish the update from the start with a peer's statistics"
    UPDATE_DONE = "its update is already complete"
    REDO = "redo the interrupted iteration"
    AT_BOUNDARY = "resume at the boundary"
    FILL = "receive a replica's state at the boundary"
    STANDBY = "hold nothing (a rank of no stage): write its marker at the boundary"


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    path: RestorePath
    reason: str
    next_iteration: int = 0
    """RESUME: the first iteration the loop runs."""
    finish: int | None = None
    """RESUME: the iteration whose update every rank finishes first (a rank passed its sync)."""
    stats: MarkerState | None = None
    """RESUME with `finish`: the synchronized statistics of that iteration (from a rank that
    recorded them), for ranks that had not recorded them yet."""
    actions: tuple[RankAction, ...] = ()
    """RESUME: each rank's action, by rank."""
    fill: tuple[tuple[int, int], ...] = ()
    """RESUME: (rank, donor) for every rank filled from a replica, the donor a rank of its
    replica set that reaches the boundary itself."""


def _fallback(reason: str) -> RestoreDecision:
    return RestoreDecision(RestorePath.FALLBACK, reason)


def _finish_action(m: MarkerState, t: int) -> RankAction | None:
    if m.stage is Stage.SYNCED and m.iteration == t:
        return RankAction.FINISH_UPDATE
    if m.stage is Stage.GRADS_PROTECTED and m.iteration == t:
        return RankAction.FINISH_WITH_PEER_STATS
    if m.stage is Stage.IDLE and m.done_iter == t:
        return RankAction.UPDATE_DONE
    return None


def decide_restore(
    rows: Sequence[RetainedSummary], replica_sets: Sequence[Sequence[int]] = ()
) -> RestoreDecision:
    """The path every rank takes after an in-place restart, from every rank's summary (in rank
    order) and the job's sets of ranks holding identical state. Pure: every rank computes it
    from the same gathered table."""
    empty = [r for r, s in enumerate(rows) if s.empty]
    if empty and len(empty) < len(rows):
        return _without_empty(rows, replica_sets, empty)
    lacking = [r for r, s in enumerate(rows) if not s.held or not s.repaired]
    if replica_sets:
        lacking += _behind(rows, lacking)
    if lacking and len(lacking) < len(rows):
        donors = _donors(lacking, replica_sets)
        if donors is not None:
            keep = [r for r in range(len(rows)) if r not in donors]
            inner = _decide([rows[r] for r in keep])
            if inner.path is RestorePath.RESUME:
                actions = dict(zip(keep, inner.actions, strict=True))
                actions.update({r: RankAction.FILL for r in donors})
                fills = ", ".join(f"{r} from {d}" for r, d in donors.items())
                return RestoreDecision(
                    RestorePath.RESUME,
                    f"{inner.reason}; rank(s) {fills} take a replica's state",
                    next_iteration=inner.next_iteration,
                    finish=inner.finish,
                    stats=inner.stats,
                    actions=tuple(actions[r] for r in range(len(rows))),
                    fill=tuple(sorted(donors.items())),
                )
    return _decide(rows)


def _without_empty(
    rows: Sequence[RetainedSummary], replica_sets: Sequence[Sequence[int]], empty: list[int]
) -> RestoreDecision:
    """The decision of the ranks that hold state; the `empty` ones stand by (`STANDBY`).

    [Note: a rank of no stage]: a plan may leave a rank of the world without a stage (a TP
    group shrunk around a slow device keeps that device as a standby; a lost device's TP peer
    joins a move to a shrunk group from a plan in which it held nothing). Such a rank holds no
    parameters, so whatever its regions say — new, or a marker of another layout — must
    neither make the others fall back nor choose their boundary: it is left out, and writes
    its marker at the boundary the others agree on."""
    keep = [r for r in range(len(rows)) if r not in empty]
    index = {r: i for i, r in enumerate(keep)}
    sets = [[index[r] for r in ranks if r in index] for ranks in replica_sets]
    inner = decide_restore([rows[r] for r in keep], [s for s in sets if len(s) > 1])
    if inner.path is not RestorePath.RESUME:
        return inner
    actions = dict(zip(keep, inner.actions, strict=True))
    actions.update({r: RankAction.STANDBY for r in empty})
    return dataclasses.replace(
        inner,
        reason=f"{inner.reason}; rank(s) {empty} hold no stage",
        actions=tuple(actions[r] for r in range(len(rows))),
        fill=tuple((keep[t], keep[d]) for t, d in inner.fill),
    )


def _behind(rows: Sequence[RetainedSummary], lacking: list[int]) -> list[int]:
    """Ranks whose repaired state is older than the job's: neither at the newest iteration any
    rank completed, t, nor inside the update of t (past its sync, or protected for it while a
    peer passed it). A device that stood by outside the world (its replica dissolved) rejoins
    a grown world so, with the iteration it left at; a marker rebuilt one write behind can
    too. Such a rank takes a replica's state like one that retained nothing (every persistent
    byte is overwritten, parity and marker written again), where a replica has it."""
    current = [s.marker for r, s in enumerate(rows) if r not in lacking and s.marker is not None]
    if not current:
        return []
    t = max(m.done_iter for m in current)

    def is_behind(m: MarkerState) -> bool:
        inside = m.iteration == t and m.stage in (Stage.SYNCED, Stage.GRADS_PROTECTED)
        return m.done_iter < t and not inside

    return [
        r
        for r, s in enumerate(rows)
        if r not in lacking and s.marker is not None and is_behind(s.marker)
    ]


def _donors(lacking: list[int], replica_sets: Sequence[Sequence[int]]) -> dict[int, int] | None:
    """rank -> donor (the lowest rank of its replica set that is not lacking), or None when a
    lacking rank has no such replica."""
    out = {}
    for r in lacking:
        peers = [d for ranks in replica_sets if r in ranks for d in ranks if d not in lacking]
        if not peers:
            return None
        out[r] = min(peers)
    return out


def _decide(rows: Sequence[RetainedSummary]) -> RestoreDecision:
    nothing = [r for r, s in enumerate(rows) if not s.held]
    if nothing:
        if any(s.progress for s in rows):
            return _fallback(f"rank(s) {nothing} retained nothing and peers made progress")
        return RestoreDecision(
            RestorePath.START_OVER, f"rank(s) {nothing} retained nothing; no rank made progress"
        )
    broken = [r for r, s in enumerate(rows) if not s.repaired]
    if broken:
        return _fallback(f"rank(s) {broken} could not repair their retained state")
    markers = [s.marker for s in rows]
    assert all(m is not None for m in markers)
    synced = [r for r, m in enumerate(markers) if m.stage is Stage.SYNCED]
    if synced:
        t = markers[synced[0]].iteration
        if any(markers[r].iteration != t for r in synced):
            return _fallback(f"ranks synced different iterations: {[m.iteration for m in markers]}")
        actions = [_finish_action(m, t) for m in markers]
        if None in actions:
            bad = actions.index(None)
            return _fallback(f"rank {bad}'s marker {markers[bad]} cannot join the update of {t}")
        return RestoreDecision(
            RestorePath.RESUME,
            f"rank {synced[0]} passed the sync of {t}: every rank finishes its update",
            next_iteration=t + 1,
            finish=t,
            stats=markers[synced[0]],
            actions=tuple(actions),
        )
    done = {m.done_iter for m in markers}
    if len(done) != 1:
        return _fallback(f"ranks completed different iterations: {[m.done_iter for m in markers]}")
    action = RankAction.REDO if any(m.stage for m in markers) else RankAction.AT_BOUNDARY
    nxt = done.pop() + 1
    return RestoreDecision(
        RestorePath.RESUME,
        f"{action.value} {nxt}" if action is RankAction.REDO else f"resume at iteration {nxt}",
        next_iteration=nxt,
        actions=tuple(RankAction.REDO if m.stage else RankAction.AT_BOUNDARY for m in markers),
    )
