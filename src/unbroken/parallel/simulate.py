"""Dry-run simulator: time a plan's action lists, find its bubbles, critical path and deadlocks.

Owns the one model of a schedule that the detector, the scheduler and the cluster simulator
reuse (ResiHP §5.2, eq. 2): a dependency-driven discrete-event replay in which

- each rank runs its list strictly in order, one item at a time;
- a compute action (F, B, W) is run by the stage's whole TP group together: it starts when
  every member has reached it (``t_start = max`` over predecessors, eq. 2) and lasts its cost
  times the group's slowest member's slowdown;
- a run of consecutive SEND/RECV actions is one batch ([Note: communication placement] in
  `schedules`), posted together; the rank moves on when all its transfers are done. With
  ``sends="eager"`` (default: the DAG of eq. 2, and what an interpreter that waits for its sends
  late achieves) a send never holds its rank and a receive ends no earlier than the send's post
  + link time; with ``sends="rendezvous"`` (blocking p2p) a transfer starts when both ends have
  posted it, lasts the link time, and holds both ranks;
- whatever the timing mode, the lists are also replayed under rendezvous semantics: an order
  that would hang with blocking sends is reported even when the eager timing completes (with
  in-order ranks, whether a replay completes does not depend on the costs);
- REDUCE_GRAD is a collective over one physical stage's ranks in every replica; OPT_STEP is
  local;
- a rank starts its list `Costs.step_lead` late (0 by default). The scheduler replays one
  iteration of the steady state with it: a rank's optimizer step runs after the world-wide
  sync and before its next iteration's first action, and a slow device steps slowly too, so
  it starts late by the part of its previous step a healthy rank's does not have, and every
  rank's closing OPT_STEP lasts `opt_step` (`unbroken.plan.score`, [Note: step lead]).

When the lists cannot complete, the replay stops instead of hanging and reports the actions each
stuck rank is blocked on, together with the static problems of `unbroken.parallel.check`.

Pure Python; never imports torch, never touches a process group or the clock.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from unbroken.parallel.actions import COMM_KINDS, COMPUTE_KINDS, Action, ActionKind
from unbroken.parallel.check import Problem, check_plan, pair_transfers
from unbroken.parallel.costs import Costs, Work
from unbroken.parallel.plan import ParallelPlan

__all__ = [
    "DeadlockError",
    "TimedAction",
    "Timeline",
    "iteration_time",
    "simulate",
    "timeline_csv",
]

Ref = tuple[int, int]
"""(rank, index) of one action."""
_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})


@dataclass(frozen=True, slots=True)
class TimedAction:
    """When one action ran."""

    rank: int
    index: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        """end - start."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Timeline:
    """The outcome of `simulate`."""

    actions: tuple[TimedAction, ...]
    """Every action that completed, by (rank, index)."""
    iteration_time: float
    """End of the last action; ``inf`` when some rank is stuck."""
    busy: Mapping[int, float]
    """Per rank, time spent in compute (F, B, W)."""
    bubble: Mapping[int, float]
    """Per rank, iteration_time - busy: waiting, communication, reduction and step."""
    critical_path: tuple[TimedAction, ...]
    """A chain of actions, each starting when its predecessor's end allowed it, that ends at
    the last action: what to shorten to shorten the iteration."""
    deadlocks: tuple[Problem, ...]
    """Static problems and stuck actions; empty when the lists are coherent and complete."""

    @property
    def ok(self) -> bool:
        """True when the plan is coherent and ran to completion."""
        return not self.deadlocks

    def of(self, rank: int) -> tuple[TimedAction, ...]:
        """The timed actions of one rank, in order."""
        return tuple(t for t in self.actions if t.rank == rank)

    def bubble_fraction(self) -> float:
        """Mean over ranks of bubble / iteration time."""
        if not self.bubble or not math.isfinite(self.iteration_time) or self.iteration_time == 0:
            return 0.0
        return sum(self.bubble.values()) / (len(self.bubble) * self.iteration_time)


class DeadlockError(ValueError):
    """A plan's action lists cannot run to completion (raised by `iteration_time`)."""

    def __init__(self, problems: tuple[Problem, ...]) -> None:
        shown = "; ".join(map(str, problems[:5]))
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        super().__init__(f"plan cannot run: {shown}{more}")
        self.problems = problems


def _items(comm: list[bool]) -> list[tuple[int, int]]:
    """Split a list (`comm[i]`: action i is a SEND/RECV) into items: single non-comm actions
    and maximal runs of SEND/RECV."""
    items, i = [], 0
    while i < len(comm):
        j = i + 1
        if comm[i]:
            while j < len(comm) and comm[j]:
                j += 1
        items.append((i, j))
        i = j
    return items


class _Replay:
    """The event-driven replay behind `simulate`; one instance per call."""

    def __init__(self, plan: ParallelPlan, costs: Costs, eager: bool) -> None:
        self.plan, self.costs, self.eager = plan, costs, eager
        self.acts = dict(plan.actions)
        self.comm = {r: [a.kind in COMM_KINDS for a in acts] for r, acts in self.acts.items()}
        self.items = {r: _items(c) for r, c in self.comm.items()}
        self.partner = pair_transfers(self.acts)
        self.links: dict[tuple[int, int, int], float] = {}
        self.slow: dict[tuple[int, ...], float] = {}
        self.start: dict[Ref, float] = {}
        self.end: dict[Ref, float] = {}
        self.cause: dict[Ref, Ref | None] = {}
        self.pc = dict.fromkeys(self.acts, 0)
        self.ready = {r: float(costs.step_lead.get(r, 0.0)) for r in self.acts}
        self.bind: dict[int, Ref | None] = dict.fromkeys(self.acts)
        self.posted_pc = dict.fromkeys(self.acts, -1)
        self.post_time: dict[Ref, float] = {}
        self.post_bind: dict[Ref, Ref | None] = {}
        self._sync_keys()
        self.queue = deque(sorted(self.acts))
        self.queued = set(self.acts)

    def _sync_keys(self) -> None:
        """Key every non-comm action by the collective it takes part in."""
        plan = self.plan
        self.key: dict[Ref, tuple] = {}
        self.members: dict[tuple, dict[int, int]] = defaultdict(dict)
        self.work: dict[Ref, Work] = {}
        self.has_w = {
            r: {(a.stage, a.microbatch) for a in acts if a.kind is ActionKind.W}
            for r, acts in self.acts.items()
        }
        for rank, acts in self.acts.items():
            d, s = plan.locate(rank)
            group = plan.replicas[d].stages[s].ranks
            seen: dict[tuple, int] = defaultdict(int)
            for i, a in enumerate(acts):
                if a.is_comm:
                    continue
                if a.is_compute:
                    base: tuple = ("compute", group, (a.kind, a.stage, a.microbatch))
                    assert a.stage is not None and a.microbatch is not None
                    self.work[(rank, i)] = Work(
                        d,
                        a.stage,
                        a.kind,
                        a.microbatch,
                        plan.replicas[d].stages[a.stage].layers,
                        group,
                    )
                elif a.kind is ActionKind.REDUCE_GRAD:
                    base = ("reduce", s)
                else:
                    base = ("step", rank)
                key = (*base, seen[base])
                seen[base] += 1
                self.key[(rank, i)] = key
                self.members[key][rank] = i
        self.expect: dict[tuple, tuple[int, ...]] = {}
        for key in self.members:
            if key[0] == "compute":
                self.expect[key] = key[1]
            elif key[0] == "reduce":
                self.expect[key] = tuple(
                    r for rep in plan.replicas for r in rep.stages[key[1]].ranks
                )
            else:
                self.expect[key] = (key[1],)

    def _cost(self, key: tuple, ref: Ref) -> float:
        if key[0] == "reduce":
            return self.costs.reduce_time(key[1])
        if key[0] == "step":
            return float(self.costs.opt_step)
        work = self.work[ref]
        t = self.costs.compute_time(work)
        if work.kind is ActionKind.B and (work.stage, work.microbatch) not in self.has_w[ref[0]]:
            t += self.costs.compute_time(
                Work(
                    work.replica, work.stage, ActionKind.W, work.microbatch, work.layers, work.ranks
                )
            )
        slow = self.slow.get(work.ranks)
        if slow is None:
            slow = self.slow[work.ranks] = self.costs.slowness(work.ranks)
        return t * slow

    def _push(self, rank: int) -> None:
        if rank in self.acts and rank not in self.queued:
            self.queued.add(rank)
            self.queue.append(rank)

    def _advance(self, rank: int, end: float, bind: Ref | None) -> None:
        self.pc[rank] += 1
        self.ready[rank] = end
        self.bind[rank] = bind
        self._push(rank)

    def _post(self, rank: int, lo: int, hi: int) -> None:
        t, bind = self.ready[rank], self.bind[rank]
        post_time, post_bind, partner = self.post_time, self.post_bind, self.partner
        for i in range(lo, hi):
            ref = (rank, i)
            post_time[ref] = t
            post_bind[ref] = bind
            other = partner.get(ref)
            if other is not None:
                self._push(other[0])
        if not self.comm[rank][lo]:
            for member in self.expect[self.key[(rank, lo)]]:
                self._push(member)

    def _finish(self, ref: Ref, start: float, end: float, cause: Ref | None) -> None:
        self.start[ref], self.end[ref], self.cause[ref] = start, end, cause

    def _complete_sync(self, rank: int, lo: int) -> bool:
        key = self.key[(rank, lo)]
        expect, members = self.expect[key], self.members[key]
        post_time = self.post_time
        if len(expect) == 1:  # a group of one (rank, lo) is the only member
            last = (rank, lo)
            refs = [last]
            start = post_time[last]  # posted: `run` posts an item before completing it
        else:
            refs = [(m, members[m]) for m in expect if m in members]
            if len(refs) < len(expect) or any(ref not in post_time for ref in refs):
                return False
            start, last = max((post_time[ref], ref) for ref in refs)
        end = start + self._cost(key, (rank, lo))
        cause = self.post_bind[last]
        for ref in refs:
            self._finish(ref, start, end, cause)
            self._advance(ref[0], end, ref)
        return True

    def _resolve(self, ref: Ref) -> bool:
        """Time the transfer of comm action `ref` if its partner allows; True when timed."""
        ends = self.end
        if ref in ends:
            return True
        other = self.partner.get(ref)
        if other is None:
            return False
        rank, i = ref
        send, recv = (ref, other) if self.acts[rank][i].kind in _SENDS else (other, ref)
        post_time = self.post_time
        if self.eager:
            if send not in post_time:
                return False
            ps = post_time[send]
            if send not in ends:
                self._finish(send, ps, ps, self.post_bind[send])
            if recv == ref:
                link = self._link(send, recv)
                pr = post_time[recv]
                cause = self.post_bind[recv] if pr >= ps + link else send
                self._finish(recv, max(pr, ps), max(pr, ps + link), cause)
            return ref in ends
        link = self._link(send, recv)
        if send not in post_time or recv not in post_time:
            return False
        start, later = max((post_time[send], send), (post_time[recv], recv))
        for x in (send, recv):
            self._finish(x, start, start + link, self.post_bind[later])
        self._push(other[0])
        return True

    def _link(self, send: Ref, recv: Ref) -> float:
        """One chunk's transfer time (the costs are pure: each (src, dst, chunks) asked once)."""
        key = (send[0], recv[0], self.acts[send[0]][send[1]].num_chunks)
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = self.costs.transfer_time(*key)
        return link

    def _complete_batch(self, rank: int, lo: int, hi: int) -> bool:
        done = True
        for i in range(lo, hi):  # every one, even after a miss: sends finish as they post
            done = self._resolve((rank, i)) and done
        if not done:
            return False
        ends = self.end
        end, last = ends[(rank, lo)], (rank, lo)
        for i in range(lo + 1, hi):  # the latest end; among equal ends the last index
            if ends[(rank, i)] >= end:
                end, last = ends[(rank, i)], (rank, i)
        self._advance(rank, end, last)
        return True

    def run(self) -> None:
        queue, items, comm, pc, posted = self.queue, self.items, self.comm, self.pc, self.posted_pc
        while queue:
            rank = queue.popleft()
            self.queued.discard(rank)
            mine, flags = items[rank], comm[rank]
            while pc[rank] < len(mine):
                k = pc[rank]
                lo, hi = mine[k]
                if posted[rank] != k:
                    posted[rank] = k
                    self._post(rank, lo, hi)
                if flags[lo]:
                    progressed = self._complete_batch(rank, lo, hi)
                else:
                    progressed = self._complete_sync(rank, lo)
                if not progressed:
                    break

    def stuck(self) -> list[Problem]:
        """The blocked actions at the head of every rank that did not finish."""
        problems = []
        for rank, items in self.items.items():
            if self.pc[rank] >= len(items):
                continue
            lo, hi = items[self.pc[rank]]
            for i in range(lo, hi):
                if (rank, i) in self.end:
                    continue
                a = self.acts[rank][i]
                problems.append(Problem(rank, i, a, self._why(rank, i, a)))
        return problems

    def _why(self, rank: int, i: int, a: Action) -> str:
        if a.is_comm:
            other = self.partner.get((rank, i))
            if other is None:
                return "stuck: its peer has no matching action"
            peer_action = self.acts[other[0]][other[1]]
            return f"stuck: r{other[0]} never reaches {peer_action} (index {other[1]})"
        key = self.key[(rank, i)]
        absent = [
            m for m in self.expect[key] if (m, self.members[key].get(m, -1)) not in self.post_time
        ]
        return f"stuck: waiting for {', '.join(f'r{m}' for m in absent)} to reach it"


def simulate(
    plan: ParallelPlan,
    costs: Costs,
    *,
    sends: Literal["rendezvous", "eager"] = "eager",
    check_blocking: bool = True,
    static_checks: bool = True,
) -> Timeline:
    """Replay one iteration of `plan` under `costs` (see the module docstring for the model).

    Args:
        plan: the plan to time.
        costs: per-action costs.
        sends: timing of sends: ``"eager"`` (a send never waits) or ``"rendezvous"`` (a send
            waits for its receive: blocking p2p).
        check_blocking: with eager timing, also replay under blocking sends to report orders
            that would hang there (one more replay; callers that time a plan already known
            to be sound, like the fail-slow detector in a loop, may skip it).
        static_checks: also run `unbroken.parallel.check.check_plan` and report its problems
            (a caller that times many plans it generated itself, like the scheduler scoring
            candidates, may skip it; stuck actions are reported either way).

    Returns:
        The timeline; check ``timeline.ok`` or ``timeline.deadlocks`` before trusting times.

    Raises:
        ValueError: unknown `sends` mode, or a compute cost is missing.
    """
    if sends not in ("rendezvous", "eager"):
        raise ValueError(f"sends must be 'rendezvous' or 'eager', got {sends!r}")
    replay = _Replay(plan, costs, eager=sends == "eager")
    replay.run()
    stuck = replay.stuck()
    blocked = _blocking(plan, costs) if not stuck and replay.eager and check_blocking else []
    static = tuple(check_plan(plan)) if static_checks else ()
    problems = static + tuple(stuck) + tuple(blocked)
    timed = tuple(
        TimedAction(r, i, replay.acts[r][i], replay.start[(r, i)], replay.end[(r, i)])
        for r, acts in replay.acts.items()
        for i in range(len(acts))
        if (r, i) in replay.end
    )
    finished = max((t.end for t in timed), default=0.0)
    total = math.inf if stuck else finished
    busy = {r: 0.0 for r in replay.acts}
    for t in timed:
        if t.action.kind in COMPUTE_KINDS:
            busy[t.rank] += t.end - t.start
    bubble = {r: total - b for r, b in busy.items()}
    return Timeline(
        actions=timed,
        iteration_time=total,
        busy=busy,
        bubble=bubble,
        critical_path=_critical_path(replay, timed),
        deadlocks=problems,
    )


def _blocking(plan: ParallelPlan, costs: Costs) -> list[Problem]:
    """The actions a replay with blocking sends leaves stuck (orders that would hang there)."""
    blocking = _Replay(plan, costs, eager=False)
    blocking.run()
    return [
        Problem(p.rank, p.index, p.action, f"deadlock with blocking sends: {p.reason}")
        for p in blocking.stuck()
    ]


def _critical_path(replay: _Replay, timed: tuple[TimedAction, ...]) -> tuple[TimedAction, ...]:
    if not timed:
        return ()
    last = timed[0]
    for t in timed:  # the latest end; among equal ends the lowest (rank, index)
        if t.end > last.end or (t.end == last.end and (t.rank, t.index) < (last.rank, last.index)):
            last = t
    path: list[TimedAction] = []
    ref: Ref | None = (last.rank, last.index)
    while ref is not None and ref in replay.end:
        r, i = ref
        path.append(TimedAction(r, i, replay.acts[r][i], replay.start[ref], replay.end[ref]))
        ref = replay.cause.get(ref)
    return tuple(reversed(path))


def iteration_time(
    plan: ParallelPlan, costs: Costs, *, sends: Literal["rendezvous", "eager"] = "eager"
) -> float:
    """The iteration time of `plan` under `costs`.

    Raises:
        DeadlockError: the plan's lists are incoherent or cannot complete.
    """
    timeline = simulate(plan, costs, sends=sends)
    if not timeline.ok:
        raise DeadlockError(timeline.deadlocks)
    return timeline.iteration_time


def timeline_csv(timeline: Timeline) -> str:
    """The timeline as CSV: ``rank,index,action,start,end``, one row per timed action."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["rank", "index", "action", "start", "end"])
    for t in timeline.actions:
        writer.writerow([t.rank, t.index, str(t.action), repr(t.start), repr(t.end)])
    return out.getvalue()
