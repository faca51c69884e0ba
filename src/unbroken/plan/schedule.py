"""Action lists for a planner layout: a timed 1F1B list schedule and its point-to-point batches.

Owns turning a `Layout` into every rank's action list (`to_plan`). The plan IR's own generator
(`unbroken.parallel.schedules`) orders compute by unit-cost templates and cannot express the
two things the planner changes: a stage's in-flight bound (how far its forwards may run ahead
of its backwards, deepened to hide a slow link) and orders that follow *real* costs when groups
differ in speed. So here each (replica, stage) group's compute order comes from a list schedule
at the layout's own costs:

- every group runs its micro-batches in one order (migrated-in ones interleaved by their
  position in their owner, as in `parallel.schedules.compute_steps`), backwards in forward
  order;
- whenever a group is free it starts, of what is ready, the earliest; a forward before a
  backward at equal times; a forward only while fewer than its bound are in flight. With the
  1F1B bound pp - s and equal speeds this is 1F1B's own order (warm-up forwards, then
  forward/backward pairs, then the cool-down backwards); where stages differ in speed a group
  takes whatever is ready first instead of idling. Should the bounds ever stall every group, the earliest forward is let
  through, which always makes progress.

[Note: receive placement] Sends go right after the compute that produced them. A receive goes
into the batch before the first step that starts after its message is there in the list
schedule — the schedule itself is the witness of [Note: migration placement] in
`unbroken.parallel.schedules`: listed with instant transfers, it is a blocking-send execution in
which every transfer sits at the same instant on both ends, so those lists cannot deadlock (the
*instant* placement). Over a slow link that placement makes a group wait in an early batch for
data it needs only later, so a component with a slow link is listed with each message's link
time instead and a receive goes where the message *arrives* (the *arrival* placement). With
blocking sends that placement is not always safe (a receive placed late can close a cycle of
waits through a faster third group); it is kept only if the simulator's blocking replay
completes, else the instant one is used (`unbroken.plan.score` decides, `to_plan` takes its
decision). Messages are chunked for heterogeneous TP degrees as in `parallel.schedules`
(`parallel.p2p_chunks`). Replicas linked by migrations are scheduled together, every other
replica on its own, so a replica's lists do not depend on unrelated replicas (the scorer relies
on it).

The timing of a plan is never taken from this schedule: `unbroken.parallel.simulate` times it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from unbroken.parallel import Action, ActionKind, ParallelPlan, p2p_chunks
from unbroken.plan.layout import Group, Layout

__all__ = [
    "ComputeCost",
    "LinkCost",
    "Orders",
    "component_actions",
    "components",
    "order_component",
    "to_plan",
    "work_lists",
]

F, B = ActionKind.F, ActionKind.B
Step = tuple[ActionKind, int, int]
"""(kind, stage, micro-batch)."""
ComputeCost = Callable[[Group, ActionKind], float]
"""Seconds of one forward or backward of group (replica, stage), slowdown included."""
LinkCost = Callable[[Group, Group], float]
"""Seconds of one message from one group to another (its slowest chunk)."""


def _no_link(a: Group, b: Group) -> float:
    return 0.0


_action = lru_cache(maxsize=1 << 16)(Action)
"""`Action(...)`, shared: actions are immutable values, and the scorer builds the same few
thousand for every candidate it times (validating each anew was a tenth of a simulation)."""


@dataclass(slots=True)
class Orders:
    """Compute orders of some groups, the witness times of every step, and where each step's
    group is."""

    order: dict[Group, list[Step]] = field(default_factory=dict)
    start: dict[Step, float] = field(default_factory=dict)
    end: dict[Step, float] = field(default_factory=dict)
    executor: dict[tuple[int, int], Group] = field(default_factory=dict)
    """(micro-batch, stage) -> the group that runs it."""


def components(layout: Layout) -> list[list[int]]:
    """Replicas grouped by migrations (owner and executor in one component), each sorted."""
    parent = list(range(layout.dp))

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    plan = layout.skeleton
    for m in layout.migrations:
        a, b = root(plan.owner(m.microbatch)), root(m.replica)
        parent[max(a, b)] = min(a, b)
    comps: dict[int, list[int]] = defaultdict(list)
    for d in range(layout.dp):
        comps[root(d)].append(d)
    return [comps[k] for k in sorted(comps)]


def work_lists(layout: Layout, replicas: Iterable[int]) -> dict[Group, list[int]]:
    """Micro-batches each group of `replicas` runs, in its run order ([Note: migration
    placement]: by position in their owner, then owner)."""
    plan = layout.skeleton
    chosen = set(replicas)
    moved = {(m.microbatch, m.stage): m.replica for m in layout.migrations}
    keyed: dict[Group, list[tuple[int, int, int]]] = {
        (d, s): [] for d in chosen for s in range(layout.pp)
    }
    for d in sorted(chosen):
        for i, m in enumerate(plan.microbatch_ids(d)):
            for s in range(layout.pp):
                keyed[(moved.get((m, s), d), s)].append((i, d, m))
    return {g: [m for _, _, m in sorted(items)] for g, items in keyed.items()}


def _producer(step: Step, pp: int) -> Step | None:
    """The compute whose output `step` consumes from another group (None: first F, last B)."""
    kind, k, m = step
    if kind is F and k > 0:
        return (F, k - 1, m)
    if kind is B and k < pp - 1:
        return (B, k + 1, m)
    return None


class _ListSchedule:
    """The timed list schedule of the module docstring, for one component."""

    def __init__(self, work: Mapping[Group, list[int]], pp: int, bound, cost, link) -> None:
        self.work, self.pp, self.link = work, pp, link
        self.bound = {g: bound(g) for g in work}
        self.cost = {g: {F: cost(g, F), B: cost(g, B)} for g in work}  # priced once per group
        self.nf = dict.fromkeys(work, 0)
        self.nb = dict.fromkeys(work, 0)
        self.clock = dict.fromkeys(work, 0.0)
        self.version = dict.fromkeys(work, 0)
        self.heap: list[tuple[float, int, Group, int, ActionKind]] = []
        self.out = Orders(order={g: [] for g in work})
        self.out.executor = {(m, g[1]): g for g, mbs in work.items() for m in mbs}

    def arrival(self, kind: ActionKind, s: int, m: int, g: Group) -> float | None:
        """When the input of step (kind, s, m) is at group `g` (None: not produced yet)."""
        k = s - 1 if kind is F else s + 1  # the producer's stage (`_producer`)
        if k < 0:
            return 0.0
        if k == self.pp:
            return self.out.end.get((F, s, m))
        done = self.out.end.get((kind, k, m))
        if done is None or self.link is _no_link:
            return done
        return done + self.link(self.out.executor[(m, k)], g)

    def candidate(self, g: Group, relaxed: bool) -> tuple[float, int, ActionKind] | None:
        mbs, s, clock = self.work[g], g[1], self.clock[g]
        nf, nb = self.nf[g], self.nb[g]
        best = None
        if nb < nf:
            ready = self.arrival(B, s, mbs[nb], g)
            if ready is not None:
                best = (max(clock, ready), 1, B)
        if nf < len(mbs) and (relaxed or nf - nb < self.bound[g]):
            ready = self.arrival(F, s, mbs[nf], g)
            if ready is not None:
                forward = (max(clock, ready), 0, F)
                if best is None or forward < best:
                    best = forward
        return best

    def refresh(self, g: Group | None) -> None:
        if g is None:
            return
        self.version[g] += 1
        best = self.candidate(g, relaxed=False)
        if best is not None:
            heapq.heappush(self.heap, (best[0], best[1], g, self.version[g], best[2]))

    def pop(self) -> tuple[float, Group, ActionKind]:
        while self.heap:
            start, _, g, ver, kind = heapq.heappop(self.heap)
            if ver == self.version[g]:
                return start, g, kind
        relaxed = [(c, g) for g in self.work if (c := self.candidate(g, relaxed=True))]
        if not relaxed:  # pragma: no cover - a forward is always ready once bounds are relaxed
            raise RuntimeError("list schedule stalled")
        (start, _, kind), g = min(relaxed)
        return start, g, kind

    def run(self) -> Orders:
        for g in self.work:
            self.refresh(g)
        for _ in range(2 * sum(len(m) for m in self.work.values())):
            start, g, kind = self.pop()
            s = g[1]
            counter = self.nf if kind is F else self.nb
            m = self.work[g][counter[g]]
            counter[g] += 1
            step = (kind, s, m)
            end = start + self.cost[g][kind]
            self.out.order[g].append(step)
            self.out.start[step], self.out.end[step] = start, end
            self.clock[g] = end
            self.refresh(g)
            self.refresh(self.out.executor.get((m, s + 1) if kind is F else (m, s - 1)))
        return self.out


def order_component(
    layout: Layout, replicas: Sequence[int], cost: ComputeCost, link: LinkCost = _no_link
) -> Orders:
    """Compute orders and witness times of one component's groups (the list schedule)."""
    work = work_lists(layout, replicas)

    def bound(g: Group) -> int:
        return layout.inflight[g[0]][g[1]]

    return _ListSchedule(work, layout.pp, bound, cost, link).run()


def _instant(orders: Orders, cost: ComputeCost, pp: int) -> Orders:
    """The same orders replayed with instant transfers: the deadlock-free witness of
    [Note: receive placement]."""
    out = Orders(order=orders.order, executor=orders.executor)
    pos = dict.fromkeys(orders.order, 0)
    clock = dict.fromkeys(orders.order, 0.0)
    left = sum(len(o) for o in orders.order.values())
    while left:
        progressed = False
        for g, order in orders.order.items():
            while pos[g] < len(order):
                step = order[pos[g]]
                producer = _producer(step, pp)
                needs = [producer] if producer else []
                if step[0] is B:
                    needs.append((F, step[1], step[2]))
                if any(n not in out.end for n in needs):
                    break
                start = max([clock[g]] + [out.end[n] for n in needs])
                out.start[step], out.end[step] = start, start + cost(g, step[0])
                clock[g] = out.end[step]
                pos[g] += 1
                left -= 1
                progressed = True
        if not progressed:  # pragma: no cover - list-schedule orders are mutually consistent
            raise RuntimeError("compute orders are mutually inconsistent")
    return out


def _transfers(kind: ActionKind, k: int, m: int, src, dst, rank: int) -> list[Action]:
    """This rank's chunks of one message (as in `parallel.schedules`)."""
    if len(src) == 1 and len(dst) == 1:  # one chunk (every reduced plan): no routing to do
        peer = dst[0] if kind in (ActionKind.SEND_F, ActionKind.SEND_B) else src[0]
        return [_action(kind, k, m, peer)]
    chunks = p2p_chunks(src, dst)
    n = len(chunks)
    if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
        return [_action(kind, k, m, b, c, n) for c, a, b in chunks if a == rank]
    return [_action(kind, k, m, a, c, n) for c, a, b in chunks if b == rank]


class _Placer:
    """Point-to-point batches around a group's compute order ([Note: receive placement])."""

    def __init__(self, layout: Layout, orders: Orders, link: LinkCost) -> None:
        self.layout, self.orders, self.link = layout, orders, link

    def ranks(self, m: int, k: int) -> tuple[int, ...]:
        return self.layout.group(*self.orders.executor[(m, k)]).ranks

    def comm(self, step: Step, here: tuple[int, ...], rank: int, send: bool) -> list[Action]:
        kind, k, m = step
        last = self.layout.pp - 1
        if kind is F and (k < last if send else k > 0):
            other = self.ranks(m, k + 1 if send else k - 1)
            if send:
                return _transfers(ActionKind.SEND_F, k, m, here, other, rank)
            return _transfers(ActionKind.RECV_F, k, m, other, here, rank)
        if kind is B and (k > 0 if send else k < last):
            other = self.ranks(m, k - 1 if send else k + 1)
            if send:
                return _transfers(ActionKind.SEND_B, k, m, here, other, rank)
            return _transfers(ActionKind.RECV_B, k, m, other, here, rank)
        return []

    def slots(self, g: Group) -> list[list[Step]]:
        """For each step of `g`, the steps whose inputs are received in the batch before it."""
        steps = self.orders.order[g]
        starts = [self.orders.start[step] for step in steps]
        out: list[list[Step]] = [[] for _ in steps]
        for step in steps:
            producer = _producer(step, self.layout.pp)
            if producer is not None:
                source = self.orders.executor[(producer[2], producer[1])]
                arrival = self.orders.end[producer] + self.link(source, g)
                out[bisect_left(starts, arrival)].append(step)
        return out

    def group(self, g: Group, slots: list[list[Step]]) -> dict[int, tuple[Action, ...]]:
        here = self.layout.group(*g).ranks
        steps = self.orders.order[g]
        out = {}
        for rank in here:
            acts: list[Action] = []
            pending: list[Action] = []
            for j, step in enumerate(steps):
                acts += pending
                for consumer in slots[j]:
                    acts += self.comm(consumer, here, rank, send=False)
                acts.append(_action(*step))
                pending = self.comm(step, here, rank, send=True)
            acts += pending
            acts += [_action(ActionKind.REDUCE_GRAD), _action(ActionKind.OPT_STEP)]
            out[rank] = tuple(acts)
        return out


def component_actions(
    layout: Layout,
    replicas: Sequence[int],
    cost: ComputeCost,
    link: LinkCost,
    *,
    safe: bool,
    only: Group | None = None,
) -> tuple[dict[int, tuple[Action, ...]], bool]:
    """Action lists of one component's ranks ([Note: receive placement]).

    Args:
        layout: the layout.
        replicas: the component.
        cost: compute seconds per group and kind.
        link: message seconds between groups.
        safe: use the instant-transfer placement (always deadlock-free) instead of the
            arrival-time one; its orders are then listed with instant transfers too, so the
            list schedule is its own witness.
        only: place the lists of this group alone (its orders still come from the whole
            component): one rank's lists without materializing everyone's.

    Returns:
        (rank -> actions, whether the arrival-time placement differs from the instant one; False
        when `safe`).
    """
    if safe:
        orders = order_component(layout, replicas, cost)
        placer = _Placer(layout, orders, _no_link)
        actions: dict[int, tuple[Action, ...]] = {}
        for g in orders.order:
            if only is None or g == only:
                actions.update(placer.group(g, placer.slots(g)))
        return actions, False
    orders = order_component(layout, replicas, cost, link)
    instant = _instant(orders, cost, layout.pp)
    timed, witness = _Placer(layout, orders, link), _Placer(layout, instant, _no_link)
    actions = {}
    differs = False
    for g in orders.order:
        if only is not None and g != only:
            continue
        late = timed.slots(g)
        differs |= late != witness.slots(g)
        actions.update(timed.group(g, late))
    return actions, differs


def to_plan(
    layout: Layout,
    cost: ComputeCost,
    link: LinkCost = _no_link,
    safe: Collection[int] = (),
) -> ParallelPlan:
    """The layout with every rank's action list (schedule label "1f1b"; see the module
    docstring for the order).

    Args:
        layout: the layout.
        cost: compute seconds per group and kind.
        link: message seconds between groups (for the arrival-time placement).
        safe: replicas whose component takes the instant-transfer placement.
    """
    actions: dict[int, tuple[Action, ...]] = {}
    for comp in components(layout):
        part, _ = component_actions(layout, comp, cost, link, safe=comp[0] in safe)
        actions.update(part)
    skeleton = layout.skeleton
    return ParallelPlan(
        replicas=skeleton.replicas,
        num_layers=skeleton.num_layers,
        microbatches=skeleton.microbatches,
        schedule="1f1b",
        migrations=skeleton.migrations,
        actions=actions,
    )
